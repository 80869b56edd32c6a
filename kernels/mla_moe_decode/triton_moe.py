"""Routing and the small-batch fused MoE of the fused decode layer, in Triton.

    route     router partial sums -> logits (fp32) -> sigmoid scores; the top_k of
              score + correction bias (the bias steers the choice only), weights = the chosen
              unbiased scores, normalized, x routed_scaling_factor.     one program per token
    gate_up   tile (expert, intermediate block j, chunk), one work item per K split (one
              unless split, below): the tokens that chose the expert (read from the routing
              table on the device), gathered token_rows at a time into a chunk,
              h2 @ [gate; up]_e rows of block j,
              SiLU(gate) * up -> act[token, slot of e, block j]. The items are those of the
              shared expert (every token, slot top_k, its own narrower intermediate size) and
              of the local experts some token chose, in expert order: each program builds that
              list from the routing table (a histogram of the chosen ids) and takes items
              program_id, + programs, ... . The weights of an expert no token chose are never
              read, and no program is spent on it: the grid is at most as large as the most
              items the batch can make (gate_up_bounds), and the plan can cap it
              (gate_up_programs) so that a few programs each stream several items. Before,
              one program per (expert, block) of every expert that could be chosen was
              launched and the unchosen ones exited; in the H200 MoE sweep of 2026-12-03 the
              batch-1 time grew with that count (82 / 90 / 131 µs for 576 / 1152 / 2304
              programs), and batch 4 launched 2112 programs for about 4 chosen experts' 256.
              Split K: a (feature block, chunk) (a "tile") can be several items, each a part
              of the hidden dimension, so that several programs stream one block's weight rows;
              shared_splits for the shared expert's tiles, gate_up_splits for the routed
              ones. Each split stores its fp32 partial tile and counts itself in on the
              tile's counter; the split that arrives last adds the partials in split order
              (deterministic), applies SiLU-and-mul and resets the counter for the next
              launch. At batch 1 the shared expert's 256 features are 8 tiles of 32: when no
              token chooses a local expert those 8 programs are the whole kernel, and each
              streamed 917 KB alone (436 GB/s in the 2026-12-03 sweep).
    down      program (hidden block n) owns out[:, block n]: it walks the chosen local experts
              in order (the same list), and for each one adds weight * (act @ down_e[block n].T)
              for those tokens; then the shared expert with weight 1. One program per output
              tile and a fixed order: deterministic, no atomics, no partial buffers. Split K
              (down_splits > 1): each split takes its part of every expert's intermediate
              dimension, and the last split of a tile sums them as gate_up's splits do.
    down as items (down_programs > 0; the plan of runs 19 and 20 above batch 4): item
              (tile, column block), a tile being the shared expert's or a chosen expert's
              chunk of token_rows gathered tokens, as in gate_up; a few programs per SM loop
              over the items, so that one program's pipeline refill at an item's start
              overlaps the others' streaming (the walker refills at every expert with one or
              two programs per SM, and read at 3.2-3.8 TB/s where the gate_up read 4.4-4.6).
              Each item stores its tokens' weighted rows in an fp32 workspace at (token,
              slot); the column block's last item sums each token's slots and writes out.
    stream    (stream_programs > 0; the plan above batch 4 since 2026-12-06): the gate_up's
              items and then the down's items (as above, unsplit) in one kernel. Each program
              claims the next item from a counter until none is left; a gate_up item counts
              itself in on its expert's ready counter, a down item waits there until all of
              its expert's gate_up items are in, so the gate_up's last items and the down's
              first run side by side rather than across a kernel boundary. The wait always
              ends: it is on items claimed earlier by running programs that wait on nothing.

Tokens are never sorted. The gate_up gathers an expert's tokens into tiles of token_rows rows
(a chunk; an expert with more tokens has several, whose items come one after another so that
all but the first read the weights from L2): at batch 64 a local expert has one or two tokens,
and a tile of all 64 rows, the rest masked, took shared memory and MMA slots that a deeper
pipeline needs (docs/mla_moe_notes.md, seventeenth session). The walking down kernel loads all
B rows of act with a mask that keeps only the expert's tokens (masked rows move no memory):
gathering them there meant putting each tile row back in its token's row of the output, by a
small fp32 matrix product per expert, and that cost more than it saved; the down as items puts
them back through the workspace instead. Weights of experts routed to
other GPUs' experts are normalized with the rest (as the stock path does) and then simply never
match a local expert.
Precision (ROUNDING in triton_common.py): router logits fp32; gate/up stay fp32, and SiLU-and-mul
is rounded once, to the down GEMM's bf16 operand; the down projections, the routing weights and
the expert sum stay fp32 until the single final rounding. The stock path also rounds gate/up,
each expert's output and the routed sum: this is at least as accurate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_common import (
    k_splits,
    mma,
    on_gpu,
    pdl_options,
    round_bf16,
    rows_per_program,
    sum_splits,
    wait_for_previous_kernel,
)

# How the routing kernels pick each row's experts (same ids, ties to the lower id; the weights'
# normalizing sum may add in another order, so their last bit may differ):
# "argmax": TOP_K rounds of arg-max, then every slot's score in one reduction (the plan);
#     "argmax, weights in loop": the first build, one reduction per slot inside the rounds;
#     "rank": every expert's rank at once (_route_by_rank; built 2026-12-07, not yet measured).
ROUTE_METHODS = {"argmax": 0, "argmax, weights in loop": 1, "rank": 2}
RANK_CHUNK = tl.constexpr(32)  # experts compared at a time by the rank method


@dataclass(frozen=True)
class MoeBlocks:
    block_m: int  # >= batch (>= 16 on the GPU)
    gate_up_cols: int  # intermediate features per gate_up program (it reads 2x that many rows)
    gate_up_k: int  # hidden columns per gate_up pipeline step
    down_cols: int  # hidden outputs per down program
    down_k: int  # intermediate columns per down pipeline step
    num_warps: int
    num_stages: int
    gate_up_splits: int = 1  # programs that share one (expert, feature block) over the hidden dim
    down_splits: int = 1  # programs that share one output block over the intermediate dims
    gate_up_programs: int = 0  # at most this many gate_up programs; 0: one per item
    shared_splits: int = 1  # programs that share one shared-expert feature block over hidden
    token_rows: int = 0  # token rows of one MMA tile (>= 16 on the GPU); 0: block_m
    # > 0: the down as (tile, column block) items, token_rows tiles, over at most this many
    # programs (_down_items_kernel); 0: one program per column block walking the experts
    down_programs: int = 0
    # > 0: the gate_up's and the down's items as one stream over at most this many programs,
    # one kernel (_moe_stream_kernel); the down's items as down_programs' with down_cols
    stream_programs: int = 0


@triton.jit
def silu_and_mul(gate, up):
    """fp32 gate, up -> SiLU(gate) * up in bf16, rounded once: the down GEMM's operand."""
    return round_bf16(gate / (1.0 + tl.exp(-gate)) * up)


@triton.jit
def _route_kernel(
    part_ptr,  # (splits, B, E_TOTAL) fp32: router partial sums
    bias_ptr,  # (E_TOTAL,) fp32: e_score_correction_bias
    ids_ptr,  # (B, TOP_K) int32 out: global expert ids
    weights_ptr,  # (B, TOP_K) fp32 out
    scratch_ptr,  # (B, BLOCK_E) fp32, METHOD 2 only
    N_SPLITS: tl.constexpr,  # sum_splits unrolls over it
    split_stride,
    B,
    E_TOTAL,
    scaling,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr,  # ROUTE_METHODS
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < B
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < E_TOTAL
    logit_at = rows[:, None] * E_TOTAL + experts[None, :]  # (ROWS, BLOCK_E)
    logits = sum_splits(
        part_ptr, logit_at, row_mask[:, None] & e_mask[None, :], N_SPLITS, split_stride
    )
    route_rows(
        logits, rows, row_mask, bias_ptr, ids_ptr, weights_ptr, scratch_ptr, E_TOTAL, scaling,
        TOP_K, NORMALIZE, ROWS, BLOCK_E, BLOCK_K, METHOD,
    )  # fmt: skip


@triton.jit
def route_rows(
    logits,  # (ROWS, BLOCK_E) fp32: the router logits of these rows (any value past E_TOTAL)
    rows,  # (ROWS,)
    row_mask,  # (ROWS,)
    bias_ptr,  # (E_TOTAL,) fp32: e_score_correction_bias
    ids_ptr,  # (B, TOP_K) int32 out: global expert ids
    weights_ptr,  # (B, TOP_K) fp32 out
    scratch_ptr,  # (B, BLOCK_E) fp32: the biased scores, for METHOD 2
    E_TOTAL,
    scaling,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr,
):
    """The routing of these rows from their logits (the module docstring's `route`): stores
    their ids and weights, by ROUTE_METHODS[METHOD]."""
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < E_TOTAL
    scores = 1.0 / (1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + experts, mask=e_mask, other=0.0)
    choice = tl.where(e_mask[None, :], scores + bias[None, :], float("-inf"))
    if METHOD == 2:
        _route_by_rank(
            choice, scores, rows, row_mask, ids_ptr, weights_ptr, scratch_ptr, scaling, TOP_K,
            NORMALIZE, ROWS, BLOCK_E,
        )  # fmt: skip
    else:
        _route_by_argmax(
            choice, scores, rows, row_mask, ids_ptr, weights_ptr, scaling, TOP_K, NORMALIZE,
            ROWS, BLOCK_E, BLOCK_K, METHOD == 1,
        )  # fmt: skip


@triton.jit
def _route_by_argmax(
    choice,  # (ROWS, BLOCK_E) fp32: biased scores, -inf past E_TOTAL
    scores,  # (ROWS, BLOCK_E) fp32: unbiased
    rows,
    row_mask,
    ids_ptr,
    weights_ptr,
    scaling,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WEIGHTS_IN_LOOP: tl.constexpr,
):
    """TOP_K rounds of arg-max, each a block-wide reduction, best first."""
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)[None, :]  # (1, BLOCK_K)
    ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    weights = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    slot_of = tl.full((ROWS, BLOCK_E), BLOCK_K, tl.int32)  # each expert's slot
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)  # (ROWS,): the first of equal maxima
        picked = experts[None, :] == best[:, None]  # (ROWS, BLOCK_E)
        if WEIGHTS_IN_LOOP:
            weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # the unbiased score
            weights = tl.where(slots == slot, weight[:, None], weights)
        slot_of = tl.where(picked, slot, slot_of)
        ids = tl.where(slots == slot, best[:, None], ids)
        choice = tl.where(picked, float("-inf"), choice)
    if not WEIGHTS_IN_LOOP:
        # every slot's unbiased score in one reduction after the loop, rather than one per
        # slot inside it: each is a block-wide reduction (shared memory and barriers) on the
        # routing kernel's critical path. One nonzero term per slot, so the same scores; the
        # weights come out in another register layout, so on the GPU the normalizing sum below
        # may add the eight in another order (the last bit of a weight; measured 2026-12-04)
        at_slot = slot_of[:, None, :] == slots[:, :, None]  # (ROWS, BLOCK_K, BLOCK_E)
        weights = tl.sum(tl.where(at_slot, scores[:, None, :], 0.0), axis=2)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=1, keep_dims=True)
    weights = weights * scaling
    out_at = rows[:, None] * TOP_K + slots
    out_mask = row_mask[:, None] & (slots < TOP_K)
    tl.store(ids_ptr + out_at, ids, mask=out_mask)
    tl.store(weights_ptr + out_at, weights, mask=out_mask)


@triton.jit
def _route_by_rank(
    choice,  # (ROWS, BLOCK_E) fp32: biased scores, -inf past E_TOTAL
    scores,  # (ROWS, BLOCK_E) fp32: unbiased
    rows,
    row_mask,
    ids_ptr,
    weights_ptr,
    scratch_ptr,
    scaling,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Each expert's rank: how many experts come before it (a larger biased score, or an equal
    one at a lower id), the order the arg-max rounds pick them in. The experts ranked below
    TOP_K are stored at their rank. No round depends on the one before: the biased scores go
    through memory once (each expert is compared with every other, RANK_CHUNK at a time), and
    the only block-wide reduction is the weights' normalizing sum."""
    experts = tl.arange(0, BLOCK_E)
    at = rows[:, None] * BLOCK_E + experts[None, :]  # (ROWS, BLOCK_E)
    tl.store(scratch_ptr + at, choice, mask=row_mask[:, None])
    tl.debug_barrier()  # every thread's scores stored before any is read back
    rank = tl.zeros((ROWS, BLOCK_E), dtype=tl.int32)
    for first in tl.static_range(0, BLOCK_E, RANK_CHUNK):
        others = first + tl.arange(0, RANK_CHUNK)  # (RANK_CHUNK,)
        theirs = tl.load(
            scratch_ptr + rows[:, None, None] * BLOCK_E + others[None, None, :],
            mask=row_mask[:, None, None],
            other=0.0,
        )  # (ROWS, 1, RANK_CHUNK)
        mine = choice[:, :, None]
        lower_id = others[None, None, :] < experts[None, :, None]
        before = (theirs > mine) | ((theirs == mine) & lower_id)
        rank += tl.sum(before.to(tl.int32), axis=2)
    chosen = rank < TOP_K  # past E_TOTAL the scores are -inf: ranked E_TOTAL and after
    weights = tl.where(chosen, scores, 0.0)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=1, keep_dims=True)
    weights = weights * scaling
    out_at = rows[:, None] * TOP_K + rank
    out_mask = row_mask[:, None] & chosen
    tl.store(ids_ptr + out_at, experts[None, :] + tl.zeros_like(rank), mask=out_mask)
    tl.store(weights_ptr + out_at, weights, mask=out_mask)


def route(
    parts: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    num_warps: int = 4,
    method: str = "argmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts (splits, B, E_total) fp32 -> (ids (B, top_k) int32 global, weights (B, top_k) fp32),
    picked by ROUTE_METHODS[method]."""
    n_splits, batch, n = parts.shape
    experts_total = bias.shape[0]
    if n != experts_total:
        raise ValueError(f"route: {n} columns of router sums for {experts_total} experts")
    ids = torch.empty(batch, top_k, device=parts.device, dtype=torch.int32)
    weights = torch.empty(batch, top_k, device=parts.device, dtype=torch.float32)
    rows = rows_per_program(batch, on_gpu(parts))
    _route_kernel[(triton.cdiv(batch, rows),)](
        parts,
        bias,
        ids,
        weights,
        route_scratch(parts, experts_total, method),
        n_splits,
        parts.stride(0),
        batch,
        experts_total,
        scaling,
        TOP_K=top_k,
        NORMALIZE=normalize,
        ROWS=rows,
        BLOCK_E=triton.next_power_of_2(experts_total),
        BLOCK_K=triton.next_power_of_2(top_k),
        METHOD=route_method_number(method),
        num_warps=num_warps,
        **pdl_options(parts.device),
    )
    return ids, weights


def route_method_number(method: str) -> int:
    """The routing kernels' METHOD constexpr for a ROUTE_METHODS name."""
    if method not in ROUTE_METHODS:
        raise ValueError(f"routing method {method!r}: one of {', '.join(ROUTE_METHODS)}")
    return ROUTE_METHODS[method]


def route_scratch(like: torch.Tensor, experts_total: int, method: str) -> torch.Tensor:
    """The rank method's (B, BLOCK_E) fp32 buffer for the biased scores; a placeholder (never
    read) for the others."""
    rows = like.shape[-2] if route_method_number(method) == 2 else 1
    width = triton.next_power_of_2(experts_total)
    return torch.empty(rows, width, device=like.device, dtype=torch.float32)


@triton.jit
def _routing_table(ids_ptr, rows, row_mask, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_M, BLOCK_K) int32: each row's global expert ids, -1 in padding."""
    slots = tl.arange(0, BLOCK_K)
    return tl.load(
        ids_ptr + rows[:, None] * TOP_K + slots[None, :],
        mask=row_mask[:, None] & (slots < TOP_K)[None, :],
        other=-1,
    )


@triton.jit
def _choosers(table, expert_id, BLOCK_K: tl.constexpr):
    """Which rows of the routing table chose one global expert id: (chosen (BLOCK_M,) bool,
    slot (BLOCK_M,) int32 where it sits in the row, match (BLOCK_M, BLOCK_K) bool)."""
    slots = tl.arange(0, BLOCK_K)
    match = table == expert_id
    chosen = tl.max(match.to(tl.int32), axis=1) > 0
    slot = tl.sum(tl.where(match, slots[None, :], 0), axis=1)
    return chosen, slot, match


@triton.jit
def _chosen_local_experts(
    ids_ptr,
    B,
    E,
    expert_offset,
    TOP_K: tl.constexpr,
    BLOCK_IDS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The local experts some token chose, from the routing table: (rank (2 BLOCK_E,) int32,
    indexed by local expert: each chosen expert's place in expert order from 0, -1 for the
    rest and for the bins past E; how many were chosen; counts (2 BLOCK_E,) int32: how many
    tokens chose each local expert, 0 past E)."""
    flat = tl.arange(0, BLOCK_IDS)  # (token, slot) pairs
    local = tl.load(ids_ptr + flat, mask=flat < B * TOP_K, other=-1) - expert_offset
    # ids of other GPUs' experts and padding count in a bin past every local one
    local = tl.where((local >= 0) & (local < E), local, 2 * BLOCK_E - 1)
    experts = tl.arange(0, 2 * BLOCK_E)
    counts = tl.where(experts < E, tl.histogram(local, 2 * BLOCK_E), 0)
    chosen = counts > 0
    rank = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    return tl.where(chosen, rank, -1), tl.sum(chosen.to(tl.int32), axis=0), counts


@triton.jit
def _compact_rows(chosen, slot, first, BLOCK_M: tl.constexpr, TOKENS: tl.constexpr):
    """The chosen rows numbered first .. first + TOKENS - 1, gathered into one MMA tile: (token
    (TOKENS,) int32 row index, its slot, valid (TOKENS,) bool). A tile only as tall as the
    tokens an expert has: at batch 64 a local expert has one or two, and a 64-row tile held 62
    masked rows in shared memory and the MMA."""
    rows = tl.arange(0, BLOCK_M)
    place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # (BLOCK_M,): each chosen row's number
    j = first + tl.arange(0, TOKENS)
    where = chosen[:, None] & (place[:, None] == j[None, :])  # (BLOCK_M, TOKENS)
    token = tl.sum(tl.where(where, rows[:, None], 0), axis=0)
    token_slot = tl.sum(tl.where(where, slot[:, None], 0), axis=0)
    valid = tl.max(where.to(tl.int32), axis=0) > 0
    return token, token_slot, valid


@triton.jit
def _tile_tokens(
    table,
    row_mask,
    is_shared,
    expert_id,
    chunk,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """A tile's tokens, gathered: (token, slot, valid) of chunk `chunk` of the rows that chose
    global expert `expert_id`, or of every row (slot TOP_K) for the shared expert's tile."""
    chosen, slot, _match = _choosers(table, expert_id, BLOCK_K_SLOTS)
    chosen = tl.where(is_shared, row_mask, chosen)
    slot = tl.where(is_shared, TOP_K, slot)
    return _compact_rows(chosen, slot, chunk * TOKENS, BLOCK_M, TOKENS)


@triton.jit
def _expert_at(ends, sizes, at, BLOCK_E: tl.constexpr):
    """Where `at` falls in a list laid out expert by expert (sizes (2 BLOCK_E,) per expert,
    ends their cumulative sum): (the expert, `at`'s place within that expert's part)."""
    expert = tl.sum((ends <= at).to(tl.int32), axis=0)  # the experts wholly before `at`
    first = tl.sum(tl.where(tl.arange(0, 2 * BLOCK_E) == expert, ends - sizes, 0), axis=0)
    return expert, at - first


@triton.jit
def _nth_expert(rank, n, BLOCK_E: tl.constexpr):
    """The local expert of rank n in _chosen_local_experts' list."""
    return tl.sum(tl.where(rank == n, tl.arange(0, 2 * BLOCK_E), 0), axis=0)


@triton.jit
def _last_split_sum(
    acc,
    partial_ptr,  # (slots, BLOCK_M, BLOCK_N) fp32 workspace: a tile's splits in a row
    counter_ptr,  # (tiles,) int32, zero between launches
    tile,  # the down kernel's output tile, or the gate_up's (expert, feature block, chunk)
    first_slot,  # the workspace slot of the tile's split 0
    split,  # which of the tile's n_splits this is
    n_splits,
    rows,
    row_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split-K without atomics on the data: store this split's partial tile, count in on the
    tile's counter; (the sum of every split's partial in split order, whether this split
    arrived last). The last one also resets the counter, so the next launch (a graph replay)
    finds it at zero."""
    cols = tl.arange(0, BLOCK_N)
    tile_at = partial_ptr + tl.cast(first_slot, tl.int64) * BLOCK_M * BLOCK_N
    at = rows[:, None] * BLOCK_N + cols[None, :]
    mask = row_mask[:, None]
    tl.store(tile_at + split * BLOCK_M * BLOCK_N + at, acc, mask=mask)
    tl.debug_barrier()  # every thread's store issued before the release below
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    last = arrived == n_splits - 1
    total = acc
    if last:
        # .cg: from L2, where the other splits' stores are; never a stale L1 line
        total = tl.load(tile_at + at, mask=mask, other=0.0, cache_modifier=".cg")
        for other in range(1, n_splits):
            total += tl.load(
                tile_at + other * BLOCK_M * BLOCK_N + at, mask=mask, other=0.0, cache_modifier=".cg"
            )
        tl.atomic_xchg(counter_ptr + tile, 0)
    return total, last


@triton.jit
def _gate_up_kernel(
    h_ptr,  # (B, D) bf16: post_attention_layernorm output
    ids_ptr,  # (B, TOP_K) int32
    w13_ptr,  # (E, 2 INTER, D) bf16: [gate; up] per local expert
    shared_ptr,  # (2 I_S, D) bf16: the shared expert's [gate; up]
    act_ptr,  # (B, TOP_K + 1, INTER) bf16 out: slot TOP_K is the shared expert's
    partial_ptr,  # split items: (items, TOKENS, 2 BLOCK_I) fp32 workspace, a slot per item
    counter_ptr,  # split items: (tiles,) int32, zero between launches
    B,
    D,
    INTER,
    I_SHARED,
    E,
    expert_offset,
    k_per_split,
    shared_k_per_split,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_IDS: tl.constexpr,  # >= B x TOP_K
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_E: tl.constexpr,  # >= E
    K_SPLITS: tl.constexpr,  # items per routed (expert, feature block, chunk)
    SHARED_TILES: tl.constexpr,  # the shared expert's feature blocks, whose items come first
    SHARED_SPLITS: tl.constexpr,  # items per shared (feature block, chunk)
    TOKENS: tl.constexpr,  # token rows per tile
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < B
    table = _routing_table(ids_ptr, rows, row_mask, TOP_K, BLOCK_K_SLOTS)
    # (no `_` for the unused values: a name assigned before the item loop and again in it is
    # a loop-carried variable to Triton's compiler, which then wants one type for it)
    _rank, _n_chosen, counts = _chosen_local_experts(
        ids_ptr, B, E, expert_offset, TOP_K, BLOCK_IDS, BLOCK_E
    )
    # A tile is (expert, feature block, chunk of TOKENS of the expert's tokens), one item per
    # K split. The items run expert by expert, then feature block, chunk, split: the chunks of
    # one block read the same weight rows at about the same time, so all but one read L2.
    blocks_per_expert = tl.cdiv(INTER, BLOCK_I)
    chunks = tl.cdiv(counts, TOKENS)  # (2 BLOCK_E,): 0 for the experts no token chose
    expert_items = chunks * (blocks_per_expert * K_SPLITS)
    expert_ends = tl.cumsum(expert_items, axis=0)
    shared_chunks = tl.cdiv(B, TOKENS)
    shared_items = SHARED_TILES * shared_chunks * SHARED_SPLITS
    n_items = shared_items + tl.sum(expert_items, axis=0)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        is_shared, expert, col_block, chunk, split, in_part, n_splits = _gate_up_item_at(
            item, shared_items, shared_chunks, expert_ends, expert_items, chunks, SHARED_SPLITS,
            K_SPLITS, BLOCK_E,
        )  # fmt: skip
        token, token_slot, valid = _tile_tokens(
            table, row_mask, is_shared, expert + expert_offset, chunk, TOP_K, BLOCK_K_SLOTS,
            BLOCK_M, TOKENS,
        )  # fmt: skip
        inter = tl.where(is_shared, I_SHARED, INTER)
        w_base = tl.where(is_shared, shared_ptr, w13_ptr + expert.to(tl.int64) * 2 * INTER * D)
        k_per_item = tl.where(is_shared, shared_k_per_split, k_per_split)
        k_start = split * k_per_item
        acc = _gate_up_tile(
            h_ptr, token, valid, w_base, inter, col_block, D, k_start,
            tl.minimum(k_start + k_per_item, D), TOKENS, BLOCK_I, BLOCK_K, DOT_F32,
        )  # fmt: skip
        last = n_splits == 1
        # some tile is split: its last split adds them up. Two ifs: the outer is decided at
        # compile time, so an unsplit plan compiles no atomics at all.
        if SHARED_SPLITS * K_SPLITS > 1:  # noqa: SIM102
            if n_splits > 1:
                # a tile's items are consecutive; the shared tiles' counters come first
                tile = in_part // n_splits
                counter = tl.where(is_shared, tile, SHARED_TILES * shared_chunks + tile)
                acc, last = _last_split_sum(
                    acc,
                    partial_ptr,
                    counter_ptr,
                    counter,
                    item - split,  # its split 0's slot
                    split,
                    n_splits,
                    tl.arange(0, TOKENS),
                    valid,
                    TOKENS,
                    2 * BLOCK_I,
                )
        if last:
            _store_act(
                acc, act_ptr, token, token_slot, valid, col_block, inter, INTER, TOP_K, TOKENS,
                BLOCK_I,
            )  # fmt: skip


@triton.jit
def _gate_up_item_at(
    item,
    shared_items,
    shared_chunks,
    expert_ends,
    expert_items,
    chunks,
    SHARED_SPLITS: tl.constexpr,
    K_SPLITS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Where gate_up item `item` falls: (is_shared, local expert, feature block, chunk of
    the expert's tokens, K split, its place among the shared or the routed items, the splits
    of its tile). The shared expert's items come first, then each chosen expert's; within
    one, feature block, then chunk, then split."""
    is_shared = item < shared_items
    in_part = tl.where(is_shared, item, item - shared_items)
    expert, in_expert = _expert_at(expert_ends, expert_items, in_part, BLOCK_E)
    expert_chunks = tl.sum(tl.where(tl.arange(0, 2 * BLOCK_E) == expert, chunks, 0), axis=0)
    n_chunks = tl.where(is_shared, shared_chunks, expert_chunks)
    n_splits = tl.where(is_shared, SHARED_SPLITS, K_SPLITS)
    local = tl.where(is_shared, item, in_expert)
    col_block = local // (n_chunks * n_splits)
    chunk = local // n_splits % n_chunks
    return is_shared, expert, col_block, chunk, local % n_splits, in_part, n_splits


@triton.jit
def _gate_up_tile(
    h_ptr,
    token,
    valid,
    w_base,  # (2 inter, D) bf16: one expert's [gate; up]
    inter,
    col_block,
    D,
    k_start,
    k_end,
    TOKENS: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """(TOKENS, 2 BLOCK_I) fp32: the gathered rows of h over hidden columns [k_start, k_end)
    @ the [gate; up] rows of feature block col_block, interleaved [gate f, up f, gate f+1,
    ...] so that one MMA computes both and a reshape + split separates them."""
    pair = tl.arange(0, 2 * BLOCK_I)
    feature = col_block * BLOCK_I + pair // 2
    w_rows = w_base + ((pair % 2) * inter + feature)[:, None] * D  # (2 BLOCK_I, 1)
    f_mask = feature < inter
    acc = tl.zeros((TOKENS, 2 * BLOCK_I), dtype=tl.float32)
    for first in range(k_start, k_end, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        h = tl.load(
            h_ptr + token[:, None] * D + ks[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )  # (TOKENS, BLOCK_K): rows past the chunk's tokens stay 0
        w = tl.load(w_rows + ks[None, :], mask=f_mask[:, None] & k_mask[None, :], other=0.0)
        acc = mma(h, tl.trans(w), acc, DOT_F32)  # (TOKENS, 2 BLOCK_I)
    return acc


@triton.jit
def _store_act(
    acc,
    act_ptr,
    token,
    slot,
    valid,
    col_block,
    inter,
    INTER,
    TOP_K: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """The gate_up epilogue: (TOKENS, 2 BLOCK_I) fp32 sums of interleaved [gate f, up f]
    rows -> SiLU(gate) * up, rounded once to bf16 (the down GEMM's operand), into
    act[token, slot] of each valid tile row."""
    gate, up = tl.split(tl.reshape(acc, (TOKENS, BLOCK_I, 2)))
    act = silu_and_mul(gate, up)
    cols = col_block * BLOCK_I + tl.arange(0, BLOCK_I)
    out_at = act_ptr + (token * (TOP_K + 1) + slot)[:, None] * INTER + cols[None, :]
    tl.store(out_at, act, mask=valid[:, None] & (cols < inter)[None, :])


@triton.jit
def _down_tile(
    act_ptr,
    rows,
    slot,
    chosen,
    w_ptr,  # (D, inter) bf16: this expert's down projection
    inter,
    INTER,
    cols,
    col_mask,
    k_start,
    k_per_split,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    ACT_CACHE: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) fp32: act[row, slot, K range] @ w[cols, K range].T for chosen rows,
    0 for the rest; the K range is [k_start, k_start + k_per_split) within inter."""
    act_rows = act_ptr + (rows * (TOP_K + 1) + slot)[:, None] * INTER  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(k_start + k_per_split, inter)
    for first in range(k_start, k_end, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        act = tl.load(
            act_rows + ks[None, :],
            mask=chosen[:, None] & k_mask[None, :],
            other=0.0,
            cache_modifier=ACT_CACHE,
        )
        w = tl.load(
            w_ptr + cols[:, None] * inter + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        acc = mma(act, tl.trans(w), acc, DOT_F32)
    return acc


@triton.jit
def _down_kernel(
    act_ptr,  # (B, TOP_K + 1, INTER) bf16
    ids_ptr,  # (B, TOP_K) int32
    weights_ptr,  # (B, TOP_K) fp32
    w2_ptr,  # (E, D, INTER) bf16
    shared_ptr,  # (D, I_S) bf16
    out_ptr,  # (B, D) bf16 out
    partial_ptr,  # K_SPLITS > 1: (column blocks, K_SPLITS, BLOCK_M, BLOCK_N) fp32 workspace
    counter_ptr,  # K_SPLITS > 1: (column blocks,) int32, zero between launches
    B,
    D,
    INTER,
    I_SHARED,
    E,
    expert_offset,
    k_per_split,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    col_block = tl.program_id(0)
    k_start = tl.program_id(2) * k_per_split  # this split's part of every intermediate dim
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < B
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D
    slots = tl.arange(0, BLOCK_K_SLOTS)
    routing_weights = tl.load(
        weights_ptr + rows[:, None] * TOP_K + slots[None, :],
        mask=row_mask[:, None] & (slots < TOP_K)[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_K_SLOTS)
    table = _routing_table(ids_ptr, rows, row_mask, TOP_K, BLOCK_K_SLOTS)  # read once
    rank, n_chosen, _counts = _chosen_local_experts(
        ids_ptr, B, E, expert_offset, TOP_K, BLOCK_IDS, BLOCK_E
    )
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for n in range(0, n_chosen):  # in expert order, as the sum's order must not vary
        expert = _nth_expert(rank, n, BLOCK_E)
        chosen, slot, match = _choosers(table, expert + expert_offset, BLOCK_K_SLOTS)
        w_expert = w2_ptr + (expert * D).to(tl.int64) * INTER  # int64: E * D * I is large
        down = _down_tile(
            act_ptr,
            rows,
            slot,
            chosen,
            w_expert,
            INTER,
            INTER,
            cols,
            col_mask,
            k_start,
            k_per_split,
            TOP_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_F32,
            "",
        )
        weight = tl.sum(tl.where(match, routing_weights, 0.0), axis=1)  # (BLOCK_M,)
        out += down * weight[:, None]
    shared_slot = tl.zeros((BLOCK_M,), dtype=tl.int32) + TOP_K
    out += _down_tile(
        act_ptr,
        rows,
        shared_slot,
        row_mask,
        shared_ptr,
        I_SHARED,
        INTER,
        cols,
        col_mask,
        k_start,
        k_per_split,
        TOP_K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_F32,
        "",
    )
    if K_SPLITS > 1:
        out, last = _last_split_sum(
            out,
            partial_ptr,
            counter_ptr,
            col_block,
            col_block * K_SPLITS,
            tl.program_id(2),
            K_SPLITS,
            rows,
            row_mask,
            BLOCK_M,
            BLOCK_N,
        )
    else:
        last = True
    if last:
        out_at = out_ptr + rows[:, None] * D + cols[None, :]
        tl.store(out_at, round_bf16(out), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_items_kernel(
    act_ptr,  # (B, TOP_K + 1, INTER) bf16
    ids_ptr,  # (B, TOP_K) int32
    weights_ptr,  # (B, TOP_K) fp32
    w2_ptr,  # (E, D, INTER) bf16
    shared_ptr,  # (D, I_S) bf16
    out_ptr,  # (B, D) bf16 out
    y_ptr,  # (B, TOP_K + 1, D) fp32 workspace: each (token, slot)'s weighted down row
    counter_ptr,  # (column blocks,) int32, zero between launches
    B,
    D,
    INTER,
    I_SHARED,
    E,
    expert_offset,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOKENS: tl.constexpr,  # token rows per tile
    BLOCK_SLOTS: tl.constexpr,  # >= TOP_K + 1
    PDL: tl.constexpr,
):
    """The down as work items, as the gate_up runs: a tile is (the shared expert or a chosen
    local expert, chunk of TOKENS of its tokens), an item is (tile, column block), and a few
    programs per SM loop over the items, so that one program's pipeline refill at an item's
    start overlaps the others' streaming. Each item stores its tokens' weighted rows into y at
    (token, slot); the last item of a column block to finish sums each token's slots (the
    shared expert's is slot TOP_K) and writes out. Deterministic: one writer per y row, and
    the sum's order is fixed."""
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < B
    table = _routing_table(ids_ptr, rows, row_mask, TOP_K, BLOCK_K_SLOTS)
    _rank, _n_chosen, counts = _chosen_local_experts(
        ids_ptr, B, E, expert_offset, TOP_K, BLOCK_IDS, BLOCK_E
    )
    chunks = tl.cdiv(counts, TOKENS)  # (2 BLOCK_E,) tiles per expert, 0 for the unchosen
    expert_ends = tl.cumsum(chunks, axis=0)
    shared_tiles = tl.cdiv(B, TOKENS)
    n_tiles = shared_tiles + tl.sum(chunks, axis=0)
    column_blocks = tl.cdiv(D, BLOCK_N)
    for item in range(tl.program_id(0), n_tiles * column_blocks, tl.num_programs(0)):
        # tile-major: consecutive items stream one expert's weight rows in order
        tile = item // column_blocks
        is_shared, expert, chunk = _down_tile_at(tile, shared_tiles, expert_ends, chunks, BLOCK_E)
        _down_item(
            is_shared, expert, chunk, item % column_blocks, table, row_mask, act_ptr, ids_ptr,
            weights_ptr, w2_ptr, shared_ptr, out_ptr, y_ptr, counter_ptr, n_tiles, B, D, INTER,
            I_SHARED, E, expert_offset, TOP_K, BLOCK_K_SLOTS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32,
            TOKENS, BLOCK_SLOTS, "",
        )  # fmt: skip


@triton.jit
def _down_tile_at(tile, shared_tiles, expert_ends, chunks, BLOCK_E: tl.constexpr):
    """A down tile's (is_shared, local expert, chunk of its tokens): the shared expert's tiles
    first, then each chosen expert's chunks in expert order."""
    is_shared = tile < shared_tiles
    in_part = tl.where(is_shared, tile, tile - shared_tiles)
    expert, expert_chunk = _expert_at(expert_ends, chunks, in_part, BLOCK_E)
    return is_shared, expert, tl.where(is_shared, tile, expert_chunk)


@triton.jit
def _down_item(
    is_shared,
    expert,
    chunk,
    col_block,
    table,
    row_mask,
    act_ptr,
    ids_ptr,
    weights_ptr,
    w2_ptr,
    shared_ptr,
    out_ptr,
    y_ptr,
    counter_ptr,  # (column blocks,) int32, zero between launches
    n_tiles,
    B,
    D,
    INTER,
    I_SHARED,
    E,
    expert_offset,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    ACT_CACHE: tl.constexpr,  # ".cg" where act was written in this launch
):
    """One down item (a tile of the shared or a chosen expert, a column block): its tokens'
    weighted rows into y at (token, slot); the column block's last item sums the slots into
    out and resets the block's counter."""
    token, token_slot, valid = _tile_tokens(
        table, row_mask, is_shared, expert + expert_offset, chunk, TOP_K, BLOCK_K_SLOTS,
        BLOCK_M, TOKENS,
    )  # fmt: skip
    routing_weight = tl.load(
        weights_ptr + token * TOP_K + token_slot, mask=valid & (token_slot < TOP_K), other=1.0
    )  # (TOKENS,): the shared expert's is 1
    inter = tl.where(is_shared, I_SHARED, INTER)
    w_base = tl.where(is_shared, shared_ptr, w2_ptr + expert.to(tl.int64) * D * INTER)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D
    # the gathered rows' act over the whole of inter
    acc = _down_tile(
        act_ptr, token, token_slot, valid, w_base, inter, INTER, cols, col_mask, 0, inter,
        TOP_K, TOKENS, BLOCK_N, BLOCK_K, DOT_F32, ACT_CACHE,
    )  # fmt: skip
    y_rows = token * (TOP_K + 1) + token_slot  # (TOKENS,): as act's rows
    y_at = y_ptr + y_rows[:, None].to(tl.int64) * D + cols[None, :]
    tl.store(y_at, acc * routing_weight[:, None], mask=valid[:, None] & col_mask[None, :])
    tl.debug_barrier()  # every thread's store issued before the release below
    arrived = tl.atomic_add(counter_ptr + col_block, 1, sem="acq_rel")
    if arrived == n_tiles - 1:
        _sum_slots(
            y_ptr, ids_ptr, out_ptr, B, D, E, expert_offset, cols, col_mask, TOP_K, TOKENS,
            BLOCK_SLOTS,
        )  # fmt: skip
        tl.atomic_xchg(counter_ptr + col_block, 0)


@triton.jit
def _moe_stream_kernel(
    h_ptr,  # (B, D) bf16: post_attention_layernorm output
    ids_ptr,  # (B, TOP_K) int32
    weights_ptr,  # (B, TOP_K) fp32
    w13_ptr,  # (E, 2 INTER, D) bf16
    shared_gate_up_ptr,  # (2 I_S, D) bf16
    w2_ptr,  # (E, D, INTER) bf16
    shared_down_ptr,  # (D, I_S) bf16
    act_ptr,  # (B, TOP_K + 1, INTER) bf16 workspace: SiLU(gate) * up per (token, slot)
    y_ptr,  # (B, TOP_K + 1, D) fp32 workspace: each (token, slot)'s weighted down row
    out_ptr,  # (B, D) bf16 out
    sync_ptr,  # (3 + E,) int32, zero between launches: items claimed, programs done, ready
    arrivals_ptr,  # (column blocks,) int32, zero between launches
    B,
    D,
    INTER,
    I_SHARED,
    E,
    expert_offset,
    TOP_K: tl.constexpr,
    BLOCK_K_SLOTS: tl.constexpr,
    BLOCK_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    GATE_UP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SHARED_TILES: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The whole MoE as one stream of work items: every gate_up item (as _gate_up_kernel's,
    unsplit), then every down item (as _down_items_kernel's). Each program claims the next
    item from a counter until none is left, so the gate_up's last items and the down's first
    run side by side instead of across a kernel boundary. A down item of an expert waits
    until the expert's gate_up items are done (a ready counter per expert, slot 0 the shared
    expert's); those items were claimed earlier by programs that are running and wait on
    nothing, so the wait always ends, whatever the grid and however many programs are
    resident. The last program to finish puts the counters back to zero."""
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < B
    table = _routing_table(ids_ptr, rows, row_mask, TOP_K, BLOCK_K_SLOTS)
    _rank, _n_chosen, counts = _chosen_local_experts(
        ids_ptr, B, E, expert_offset, TOP_K, BLOCK_IDS, BLOCK_E
    )
    bins = tl.arange(0, 2 * BLOCK_E)
    chunks = tl.cdiv(counts, TOKENS)  # (2 BLOCK_E,) token tiles per expert, 0 if unchosen
    blocks_per_expert = tl.cdiv(INTER, BLOCK_I)
    expert_items = chunks * blocks_per_expert  # gate_up items per expert
    shared_chunks = tl.cdiv(B, TOKENS)
    shared_items = SHARED_TILES * shared_chunks
    gate_up_items = shared_items + tl.sum(expert_items, axis=0)
    n_tiles = shared_chunks + tl.sum(chunks, axis=0)
    column_blocks = tl.cdiv(D, BLOCK_N)
    n_items = gate_up_items + n_tiles * column_blocks
    ready_ptr = sync_ptr + 2
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while item < n_items:
        if item < gate_up_items:
            is_shared, expert, col_block, chunk, _split, _in_part, _n_splits = _gate_up_item_at(
                item, shared_items, shared_chunks, tl.cumsum(expert_items, axis=0),
                expert_items, chunks, 1, 1, BLOCK_E,
            )  # fmt: skip
            token, token_slot, valid = _tile_tokens(
                table, row_mask, is_shared, expert + expert_offset, chunk, TOP_K,
                BLOCK_K_SLOTS, BLOCK_M, TOKENS,
            )  # fmt: skip
            inter = tl.where(is_shared, I_SHARED, INTER)
            w_base = tl.where(
                is_shared, shared_gate_up_ptr, w13_ptr + expert.to(tl.int64) * 2 * INTER * D
            )
            acc = _gate_up_tile(
                h_ptr, token, valid, w_base, inter, col_block, D, 0, D, TOKENS, BLOCK_I,
                GATE_UP_K, DOT_F32,
            )  # fmt: skip
            _store_act(
                acc, act_ptr, token, token_slot, valid, col_block, inter, INTER, TOP_K, TOKENS,
                BLOCK_I,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's store issued before the release below
            tl.atomic_add(ready_ptr + tl.where(is_shared, 0, 1 + expert), 1, sem="release")
        else:
            tile = (item - gate_up_items) // column_blocks
            is_shared, expert, chunk = _down_tile_at(
                tile, shared_chunks, tl.cumsum(chunks, axis=0), chunks, BLOCK_E
            )
            expert_total = tl.sum(tl.where(bins == expert, expert_items, 0), axis=0)
            needed = tl.where(is_shared, shared_items, expert_total)
            ready_at = ready_ptr + tl.where(is_shared, 0, 1 + expert)
            done = tl.atomic_add(ready_at, 0, sem="acquire")
            while done < needed:
                done = tl.atomic_add(ready_at, 0, sem="acquire")
            _down_item(
                is_shared, expert, chunk, (item - gate_up_items) % column_blocks, table,
                row_mask, act_ptr, ids_ptr, weights_ptr, w2_ptr, shared_down_ptr, out_ptr, y_ptr,
                arrivals_ptr, n_tiles, B, D, INTER, I_SHARED, E, expert_offset, TOP_K,
                BLOCK_K_SLOTS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TOKENS, BLOCK_SLOTS, ".cg",
            )  # fmt: skip
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:  # every other program is past its last item
        tl.store(ready_ptr + bins, tl.zeros_like(bins), mask=bins <= E)
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)


@triton.jit
def _sum_slots(
    y_ptr,
    ids_ptr,
    out_ptr,
    B,
    D,
    E,
    expert_offset,
    cols,
    col_mask,
    TOP_K: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
):
    """out[:, cols] = each token's y rows of its local experts' slots and the shared slot,
    summed (in one fixed order) and rounded once, TOKENS rows at a time. Reads y from L2 (.cg),
    where the other programs' stores are."""
    slots = tl.arange(0, BLOCK_SLOTS)
    for first in range(0, B, TOKENS):
        rows = first + tl.arange(0, TOKENS)
        row_mask = rows < B
        local = tl.load(
            ids_ptr + rows[:, None] * TOP_K + slots[None, :],
            mask=row_mask[:, None] & (slots < TOP_K)[None, :],
            other=-1,
        ) - expert_offset  # fmt: skip
        written = ((local >= 0) & (local < E)) | (slots == TOP_K)[None, :]
        written = written & row_mask[:, None]  # (TOKENS, BLOCK_SLOTS): the y rows stored
        y_rows = rows[:, None] * (TOP_K + 1) + slots[None, :]
        y = tl.load(
            y_ptr + y_rows[:, :, None].to(tl.int64) * D + cols[None, None, :],
            mask=written[:, :, None] & col_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # (TOKENS, BLOCK_SLOTS, BLOCK_N)
        out_at = out_ptr + rows[:, None] * D + cols[None, :]
        tl.store(out_at, round_bf16(tl.sum(y, axis=1)), mask=row_mask[:, None] & col_mask[None, :])


_counters: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # smaller counter buffers graphs captured earlier may hold


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """`count` int32 counters at zero, for the split MoE kernels: kept per device and reused,
    since every launch leaves them at zero again. So one fused_moe at a time per device (the
    decode stream), and the first call must come before any CUDA-graph capture (warm-up), for
    a capture could not zero them outside its own replays. A buffer outgrown by a larger batch
    is kept alive, not freed: a graph captured with it still replays into it."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split MoE: call fused_moe once before capturing a graph")
        if counters is not None:
            _outgrown.append(counters)
        counters = torch.zeros(count, device=device, dtype=torch.int32)
        _counters[device] = counters
    return counters[:count]


def gate_up_bounds(
    batch: int,
    top_k: int,
    experts: int,
    tokens: int,
    shared_blocks: int,
    blocks_per_expert: int,
    splits: int,
    shared_splits: int,
) -> tuple[int, int, int]:
    """The most the gate_up kernel can index for any routing in which each token chose top_k
    distinct experts (route's top-k does): (shared tiles, most tiles, most items), sizing its
    grid, its split workspace and its counters. A tile is (feature block, chunk of `tokens` of
    an expert's tokens); the shared expert's come first, one chunk per `tokens` of the batch,
    then the routed: over the chosen experts, sum of cdiv(count_e, tokens) <= chosen + B top_k
    // tokens, and one each while B <= tokens (count_e <= B). Each tile is `splits` items
    (`shared_splits` for the shared expert's)."""
    shared_tiles = shared_blocks * triton.cdiv(batch, tokens)
    most_chunks = min(batch * top_k, experts)
    if batch > tokens:
        most_chunks += batch * top_k // tokens
    most_tiles = shared_tiles + most_chunks * blocks_per_expert
    most_items = shared_tiles * shared_splits + (most_tiles - shared_tiles) * splits
    return shared_tiles, most_tiles, most_items


def fused_moe(
    h: torch.Tensor,
    ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    out: torch.Tensor,
    expert_offset: int,
    blocks: MoeBlocks,
) -> None:
    """h (B, D) bf16; ids (B, top_k) int32 global; routing_weights (B, top_k) fp32;
    w13 (E, 2I, D), w2 (E, D, I), shared_gate_up (2 I_S, D), shared_down (D, I_S) bf16
    -> out (B, D) bf16: the sum over the chosen local experts of weight * SwiGLU_e(h), plus
    SwiGLU_shared(h). A token's ids must be distinct (route's top-k makes them so): the
    gate_up's grid and workspace are sized for that (gate_up_bounds)."""
    if blocks.stream_programs > 0:
        _check_ids(ids)
        _moe_stream(h, ids, routing_weights, w13, w2, shared_gate_up, shared_down, out,
                    expert_offset, blocks)  # fmt: skip
        return
    act = moe_gate_up(h, ids, w13, shared_gate_up, expert_offset, blocks)
    moe_down(act, ids, routing_weights, w2, shared_down, out, expert_offset, blocks)


def moe_gate_up(
    h: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    shared_gate_up: torch.Tensor,
    expert_offset: int,
    blocks: MoeBlocks,
) -> torch.Tensor:
    """fused_moe's first kernel: -> act (B, top_k + 1, I) bf16, SiLU(gate) * up of each
    (token, chosen local expert) in the token's slot of that expert, the shared expert's in
    slot top_k; the slots of experts on other GPUs are left as they were (never read)."""
    batch, hidden = h.shape
    experts, inter2, _ = w13.shape
    inter, shared_inter = inter2 // 2, shared_gate_up.shape[0] // 2
    _check_shared_fits(shared_inter, inter)
    _check_ids(ids)
    top_k = ids.shape[1]
    act = torch.empty(batch, top_k + 1, inter, device=h.device, dtype=h.dtype)
    k_per_split, splits = k_splits(hidden, blocks.gate_up_splits, blocks.gate_up_k)
    shared_k_per_split, shared_splits = k_splits(hidden, blocks.shared_splits, blocks.gate_up_k)
    tokens = _token_rows(h, blocks)
    shared_tiles, most_tiles, most_items = gate_up_bounds(
        batch, top_k, experts, tokens, triton.cdiv(shared_inter, blocks.gate_up_cols),
        triton.cdiv(inter, blocks.gate_up_cols), splits, shared_splits,
    )  # fmt: skip
    programs = min(most_items, blocks.gate_up_programs or most_items)
    partial, counters = act, act  # unused unless split
    if max(splits, shared_splits) > 1:
        # a slot per item and a counter per tile, for the items up to the last split one: only
        # the shared expert's when the routed tiles are whole (the plan at small batch)
        split_items = most_items if splits > 1 else shared_tiles * shared_splits
        split_tiles = most_tiles if splits > 1 else shared_tiles
        tile_size = tokens * 2 * blocks.gate_up_cols
        partial = torch.empty(split_items, tile_size, device=h.device, dtype=torch.float32)
        counters = split_counters(h.device, split_tiles)
    _gate_up_kernel[(programs,)](
        h,
        ids,
        w13,
        shared_gate_up,
        act,
        partial,
        counters,
        batch,
        hidden,
        inter,
        shared_inter,
        experts,
        expert_offset,
        k_per_split,
        shared_k_per_split,
        BLOCK_I=blocks.gate_up_cols,
        BLOCK_K=blocks.gate_up_k,
        K_SPLITS=splits,
        SHARED_TILES=triton.cdiv(shared_inter, blocks.gate_up_cols),
        SHARED_SPLITS=shared_splits,
        TOKENS=tokens,
        **_common_meta(h, ids, experts, blocks),
        **pdl_options(h.device),
    )
    return act


def moe_down(
    act: torch.Tensor,
    ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w2: torch.Tensor,
    shared_down: torch.Tensor,
    out: torch.Tensor,
    expert_offset: int,
    blocks: MoeBlocks,
) -> None:
    """fused_moe's second kernel: act (B, top_k + 1, I) from moe_gate_up -> out (B, D)."""
    batch, _, inter = act.shape
    experts, hidden, _ = w2.shape
    _check_ids(ids)
    if blocks.down_programs > 0:
        _down_items(act, ids, routing_weights, w2, shared_down, out, expert_offset, blocks)
        return
    down_k_per_split, down_splits = k_splits(inter, blocks.down_splits, blocks.down_k)
    column_blocks = triton.cdiv(hidden, blocks.down_cols)
    partial, counters = out, out  # unused unless split
    if down_splits > 1:
        tile_size = blocks.block_m * blocks.down_cols
        partial = torch.empty(
            column_blocks, down_splits, tile_size, device=act.device, dtype=torch.float32
        )
        counters = split_counters(act.device, column_blocks)
    _down_kernel[(column_blocks, 1, down_splits)](
        act,
        ids,
        routing_weights,
        w2,
        shared_down,
        out,
        partial,
        counters,
        batch,
        hidden,
        inter,
        shared_down.shape[1],
        experts,
        expert_offset,
        down_k_per_split,
        BLOCK_N=blocks.down_cols,
        BLOCK_K=blocks.down_k,
        K_SPLITS=down_splits,
        **_common_meta(act, ids, experts, blocks),
        **pdl_options(act.device),
    )


def _down_items(
    act: torch.Tensor,
    ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w2: torch.Tensor,
    shared_down: torch.Tensor,
    out: torch.Tensor,
    expert_offset: int,
    blocks: MoeBlocks,
) -> None:
    """moe_down with the down as items (blocks.down_programs > 0): _down_items_kernel."""
    batch, slots, inter = act.shape
    experts, hidden, _ = w2.shape
    top_k = ids.shape[1]
    if blocks.down_splits != 1:
        raise ValueError("fused_moe: the down's items are whole; down_splits must be 1")
    tokens = blocks.token_rows or blocks.block_m
    _, most_tiles, _ = gate_up_bounds(batch, top_k, experts, tokens, 1, 1, 1, 1)
    column_blocks = triton.cdiv(hidden, blocks.down_cols)
    programs = min(most_tiles * column_blocks, blocks.down_programs)
    y = torch.empty(batch, slots, hidden, device=act.device, dtype=torch.float32)
    _down_items_kernel[(programs,)](
        act,
        ids,
        routing_weights,
        w2,
        shared_down,
        out,
        y,
        split_counters(act.device, column_blocks),
        batch,
        hidden,
        inter,
        shared_down.shape[1],
        experts,
        expert_offset,
        BLOCK_N=blocks.down_cols,
        BLOCK_K=blocks.down_k,
        TOKENS=tokens,
        BLOCK_SLOTS=triton.next_power_of_2(top_k + 1),
        **_common_meta(act, ids, experts, blocks),
        **pdl_options(act.device),
    )


def _moe_stream(
    h: torch.Tensor,
    ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    out: torch.Tensor,
    expert_offset: int,
    blocks: MoeBlocks,
) -> None:
    """fused_moe as one kernel (blocks.stream_programs > 0): _moe_stream_kernel."""
    batch, hidden = h.shape
    experts, inter2, _ = w13.shape
    inter, shared_inter = inter2 // 2, shared_gate_up.shape[0] // 2
    _check_shared_fits(shared_inter, inter)
    if max(blocks.gate_up_splits, blocks.shared_splits, blocks.down_splits) != 1:
        raise ValueError("fused_moe: the one-kernel MoE's items are whole; splits must be 1")
    top_k = ids.shape[1]
    tokens = _token_rows(h, blocks)
    act = torch.empty(batch, top_k + 1, inter, device=h.device, dtype=h.dtype)
    y = torch.empty(batch, top_k + 1, hidden, device=h.device, dtype=torch.float32)
    shared_blocks = triton.cdiv(shared_inter, blocks.gate_up_cols)
    _, _, gate_up_items = gate_up_bounds(
        batch, top_k, experts, tokens, shared_blocks, triton.cdiv(inter, blocks.gate_up_cols),
        1, 1,
    )  # fmt: skip
    _, down_tiles, _ = gate_up_bounds(batch, top_k, experts, tokens, 1, 1, 1, 1)
    column_blocks = triton.cdiv(hidden, blocks.down_cols)
    programs = min(gate_up_items + down_tiles * column_blocks, blocks.stream_programs)
    sync = split_counters(h.device, 3 + experts + column_blocks)
    _moe_stream_kernel[(programs,)](
        h,
        ids,
        routing_weights,
        w13,
        shared_gate_up,
        w2,
        shared_down,
        act,
        y,
        out,
        sync,
        sync[3 + experts :],
        batch,
        hidden,
        inter,
        shared_inter,
        experts,
        expert_offset,
        BLOCK_I=blocks.gate_up_cols,
        GATE_UP_K=blocks.gate_up_k,
        BLOCK_N=blocks.down_cols,
        BLOCK_K=blocks.down_k,
        SHARED_TILES=shared_blocks,
        TOKENS=tokens,
        BLOCK_SLOTS=triton.next_power_of_2(top_k + 1),
        **_common_meta(h, ids, experts, blocks),
        **pdl_options(h.device),
    )


def _token_rows(h: torch.Tensor, blocks: MoeBlocks) -> int:
    tokens = blocks.token_rows or blocks.block_m
    if tokens & (tokens - 1) or (on_gpu(h) and tokens < 16):
        least = " of at least 16 on the GPU" if on_gpu(h) else ""
        raise ValueError(f"fused_moe: token_rows {tokens} must be a power of two{least}")
    return tokens


def _check_shared_fits(shared_inter: int, inter: int) -> None:
    if shared_inter > inter:  # its activations share act's rows, INTER wide
        raise ValueError(f"shared expert intermediate {shared_inter} > routed {inter}")


def _check_ids(ids: torch.Tensor) -> None:
    # the kernels histogram the ids, and tl.histogram takes int32 only: say so here, rather than
    # as a compile error inside the kernel
    if ids.dtype != torch.int32:
        raise ValueError(f"fused_moe: expert ids must be int32, not {ids.dtype}")


def _common_meta(
    x: torch.Tensor, ids: torch.Tensor, experts: int, blocks: MoeBlocks
) -> dict[str, int | bool]:
    """The compile-time parameters both MoE kernels take."""
    top_k = ids.shape[1]
    return dict(
        TOP_K=top_k,
        BLOCK_K_SLOTS=triton.next_power_of_2(top_k),
        BLOCK_IDS=triton.next_power_of_2(ids.shape[0] * top_k),
        BLOCK_M=blocks.block_m,
        DOT_F32=not on_gpu(x),
        BLOCK_E=triton.next_power_of_2(experts),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
