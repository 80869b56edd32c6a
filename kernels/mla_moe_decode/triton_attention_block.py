"""Kernels 3-8 of the fused layer as the six phases of one persistent launch: latent_prep, the
q_b GEMV, q_absorb, the split attention, the combine and w_uv.

Why: at batch 1-8 each of those six kernels costs 2.5-6 µs in the layer whatever its work (the
2026-12-04 profile, docs/mla_moe_notes.md), most of it the launch, the ramp of a small grid and
one dependent round trip to L2. A phase boundary inside one launch is a grid-wide barrier:
1.09 µs with one program per SM against 1.20 for a plain kernel boundary (launch_floor.py).

How: every program walks each phase's work items round-robin (the same tiles the six kernels'
programs compute, through the same @triton.jit tile functions, so both forms give the same
bits) and meets the others at a grid barrier before the next phase. The barrier needs every
program resident at once: `programs_that_fit` caps the grid by what the compiled kernel's
registers and shared memory let the SMs hold, and a barrier that still waits after SPIN_LIMIT
polls sets a flag and goes on (a wrong result the checks catch, never a hung job). The barrier
counter resets itself: the last program to finish zeroes it, so a replayed CUDA graph needs no
memset. One counter per device: two of these launches must not run at once on one device.

Under Triton's interpreter (the CPU) programs run one after another, so no barrier can work
there: the same kernel runs each phase as a launch of its own (PHASE = 0..5), one program per
work item; the phases' code is the code the GPU runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_attention import (
    ABSORB_ROWS,
    LOG2E,
    AttentionBlocks,
    latent_prep_rows,
    mla_combine_tile,
    mla_split_tile,
    q_absorb_tile,
    w_uv_tile,
)
from kernels.mla_moe_decode.triton_common import (
    pdl_options,
    prefetch_weights,
    rows_per_program,
    wait_for_previous_kernel,
)
from kernels.mla_moe_decode.triton_gemv import GemvBlocks, gemv_tile, prefetch_gemv_tile

PHASES = 6
ALL_PHASES = -1
# Polls of the barrier counter before a program gives up waiting (about a second on the H200):
# far above any phase here, far below a job's timeout.
SPIN_LIMIT = 1 << 20
# counter words: barrier arrivals, programs finished, barrier timeouts (sticky)
_ARRIVED, _FINISHED, _TIMEOUTS = 0, 1, 2


@triton.jit
def grid_barrier(counter_ptr, arrivals, SPIN_LIMIT: tl.constexpr):
    """Wait until `arrivals` programs in all have called this since the counter was zeroed: a
    release add of one, then acquire reads until the count is there. The bar.sync before it
    makes this program's stores part of what the release publishes. Every program of the grid
    must be resident at once; if the count is still short after SPIN_LIMIT polls, the program
    records a timeout and goes on."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (arrived < arrivals) & (polls < SPIN_LIMIT):
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if arrived < arrivals:
        tl.atomic_add(counter_ptr + 2, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _reset_when_last(counter_ptr, programs):
    """Count this program out; the last one zeroes the barrier's words for the next launch
    (every other program has passed its last barrier by then)."""
    finished = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _between_phases(counter_ptr, phase_done, programs, PHASE: tl.constexpr, SPIN: tl.constexpr):
    if PHASE == -1:
        grid_barrier(counter_ptr, phase_done * programs, SPIN)


@triton.jit
def _attention_block_kernel(
    qkv_parts_ptr,  # (qkv splits, B, Q + L + R) fp32: fused_qkv_a_proj partial sums
    q_norm_ptr,
    kv_norm_ptr,
    positions_ptr,
    turns_ptr,
    q_c_ptr,  # (B, Q) bf16: latent_prep -> q_b GEMV
    kv_new_ptr,  # (B, L + R) bf16 out
    q_b_ptr,  # (H * (N + R), Q) bf16
    q_parts_ptr,  # (q_b splits, B, H * (N + R)) fp32: q_b GEMV -> q_absorb
    kv_b_ptr,  # (H * (N + V), L) bf16
    q_lat_ptr,  # (B, H, L + R) bf16: q_absorb -> attention
    cache_ptr,  # (B, T, L + R) bf16
    max_ptr,  # (B, S, H) fp32: split -> combine
    sum_ptr,
    acc_ptr,  # (B, S, H, L) fp32
    o_lat_ptr,  # (B, H, L) bf16: combine -> w_uv
    o_ptr,  # (B, H * V) bf16 out
    counter_ptr,  # (3,) int32
    B,
    H,
    Q,
    L,
    R,
    NOPE,
    V,
    T,
    eps,
    scale_log2,
    qkv_split_stride,
    q_split_stride,
    q_b_k_per_split,
    tokens_per_split,
    n_splits,
    prep_items,
    q_b_col_blocks,
    q_b_items,
    absorb_col_blocks,
    absorb_items,
    split_items,
    combine_head_blocks,
    combine_col_blocks,
    combine_items,
    uv_col_blocks,
    uv_items,
    QKV_SPLITS: tl.constexpr,
    Q_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF_R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    GEMV_M: tl.constexpr,
    GEMV_N: tl.constexpr,
    GEMV_K: tl.constexpr,
    ABSORB_M: tl.constexpr,
    ABSORB_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COMBINE_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    COMBINE_SC: tl.constexpr,
    COMBINE_LC: tl.constexpr,
    UV_M: tl.constexpr,
    UV_V: tl.constexpr,
    UV_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PHASE: tl.constexpr,  # ALL_PHASES (-1): all six, with barriers; else that phase alone
    SPIN: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    program, programs = tl.program_id(0), tl.num_programs(0)
    q_b_n = H * (NOPE + R)
    if PREFETCH and (
        (PHASE == -1) or (PHASE == 1)
    ):  # q_b's weight slices (4.7 MB on the real shard) stream in while we wait
        for item in range(program, q_b_items, programs):
            col, split = item % q_b_col_blocks, item // q_b_col_blocks
            prefetch_gemv_tile(q_b_ptr, q_b_n, Q, q_b_k_per_split, col, split, GEMV_N, GEMV_K)
    wait_for_previous_kernel(PDL)
    if (PHASE == -1) or (PHASE == 0):
        for item in range(program, prep_items, programs):
            latent_prep_rows(
                qkv_parts_ptr, q_norm_ptr, kv_norm_ptr, positions_ptr, turns_ptr, q_c_ptr,
                kv_new_ptr, QKV_SPLITS, qkv_split_stride, B, Q, L, R, eps, item,
                ROWS, BLOCK_Q, BLOCK_L, BLOCK_HALF_R,
            )  # fmt: skip
    _between_phases(counter_ptr, 1, programs, PHASE, SPIN)
    if (PHASE == -1) or (PHASE == 1):
        for item in range(program, q_b_items, programs):
            gemv_tile(
                q_c_ptr, q_b_ptr, q_parts_ptr, B, q_b_n, Q, Q, q_b_k_per_split,
                item % q_b_col_blocks, item // q_b_col_blocks, GEMV_M, GEMV_N, GEMV_K, DOT_F32,
            )  # fmt: skip
    _between_phases(counter_ptr, 2, programs, PHASE, SPIN)
    if (PHASE == -1) or (PHASE == 2):
        for item in range(program, absorb_items, programs):
            head, rest = item % H, item // H
            q_absorb_tile(
                q_parts_ptr, kv_b_ptr, positions_ptr, turns_ptr, q_lat_ptr, Q_SPLITS,
                q_split_stride, B, H, NOPE, R, V, L, head, rest % absorb_col_blocks,
                rest // absorb_col_blocks, ABSORB_M, BLOCK_NOPE, ABSORB_L, BLOCK_HALF_R, DOT_F32,
            )  # fmt: skip
    _between_phases(counter_ptr, 3, programs, PHASE, SPIN)
    if (PHASE == -1) or (PHASE == 3):
        for item in range(program, split_items, programs):
            mla_split_tile(
                q_lat_ptr, cache_ptr, max_ptr, sum_ptr, acc_ptr, T, H, L, R, tokens_per_split,
                scale_log2, item // n_splits, item % n_splits, n_splits,
                BLOCK_H, BLOCK_T, BLOCK_L, BLOCK_R, DOT_F32,
            )  # fmt: skip
    _between_phases(counter_ptr, 4, programs, PHASE, SPIN)
    if (PHASE == -1) or (PHASE == 4):
        for item in range(program, combine_items, programs):
            col, rest = item % combine_col_blocks, item // combine_col_blocks
            mla_combine_tile(
                max_ptr, sum_ptr, acc_ptr, q_lat_ptr, kv_new_ptr, o_lat_ptr, max_ptr, sum_ptr,
                n_splits, H, L, R, scale_log2, rest // combine_head_blocks,
                rest % combine_head_blocks, col, COMBINE_HEADS, BLOCK_S, COMBINE_SC,
                COMBINE_LC, BLOCK_D, True,
            )  # fmt: skip
    _between_phases(counter_ptr, 5, programs, PHASE, SPIN)
    if (PHASE == -1) or (PHASE == 5):
        for item in range(program, uv_items, programs):
            w_uv_tile(
                o_lat_ptr, kv_b_ptr, o_ptr, B, H, NOPE, V, L, item % H, item // H,
                UV_M, UV_V, UV_K, DOT_F32,
            )  # fmt: skip
    if PHASE == -1:
        _reset_when_last(counter_ptr, programs)


@dataclass(frozen=True)
class BlockOperands:
    """What the six phases read and write, besides the plan."""

    qkv_parts: torch.Tensor  # (splits, B, Q + L + R) fp32
    q_norm: torch.Tensor  # (Q,) bf16
    kv_norm: torch.Tensor  # (L,) bf16
    q_b_proj: torch.Tensor  # (H * (N + R), Q) bf16
    kv_b_proj: torch.Tensor  # (H * (N + V), L) bf16
    positions: torch.Tensor  # (B,) int64
    turns: torch.Tensor  # (R/2,) fp64
    kv_cache: torch.Tensor  # (B, T, L + R) bf16
    kv_new: torch.Tensor  # (B, L + R) bf16 out
    o: torch.Tensor  # (B, H * V) bf16 out


def attention_block(
    ops: BlockOperands,
    nope: int,
    eps: float,
    scale: float,
    q_b: GemvBlocks,
    blocks: AttentionBlocks,
    programs_per_sm: int,
    one_launch: bool = True,
) -> None:
    """Kernels 3-8 in one launch (the GPU, unless `one_launch` is False) or as six launches of
    the same kernel, one program per work item (the CPU always): qkv_a's partial sums ->
    kv_new and o (o_proj's input), as latent_prep ... w_uv compute."""
    x = ops.qkv_parts
    batch, lora = x.shape[1], ops.kv_norm.shape[0]
    rope, q_rank = ops.kv_new.shape[1] - lora, ops.q_norm.shape[0]
    heads = ops.q_b_proj.shape[0] // (nope + rope)  # q_b_proj: H * (N + R) rows
    v_dim = ops.o.shape[1] // heads
    context = ops.kv_cache.shape[1]
    new = functools.partial(torch.empty, device=x.device)
    q_c = new(batch, q_rank, dtype=torch.bfloat16)
    q_parts = new(q_b.splits, batch, ops.q_b_proj.shape[0], dtype=torch.float32)
    q_lat = new(batch, heads, lora + rope, dtype=torch.bfloat16)
    stats = new(2, batch, blocks.splits, heads, dtype=torch.float32)
    partial = new(batch, blocks.splits, heads, lora, dtype=torch.float32)
    o_lat = new(batch, heads, lora, dtype=torch.bfloat16)
    rows = rows_per_program(batch, x.is_cuda)
    items = {
        "prep_items": triton.cdiv(batch, rows),
        "q_b_col_blocks": triton.cdiv(ops.q_b_proj.shape[0], q_b.block_n),
        "absorb_col_blocks": triton.cdiv(lora, blocks.absorb_cols),
        "combine_head_blocks": triton.cdiv(heads, blocks.combine_heads),
        "combine_col_blocks": triton.cdiv(lora, blocks.combine_cols),
        "uv_col_blocks": triton.cdiv(v_dim, blocks.uv_cols),
    }
    items["q_b_items"] = items["q_b_col_blocks"] * q_b.splits
    items["absorb_items"] = heads * items["absorb_col_blocks"] * triton.cdiv(batch, ABSORB_ROWS)
    items["split_items"] = batch * blocks.splits
    per_token = items["combine_head_blocks"] * items["combine_col_blocks"]
    items["combine_items"] = batch * per_token
    items["uv_items"] = heads * items["uv_col_blocks"]
    args = (
        x, ops.q_norm, ops.kv_norm, ops.positions, ops.turns, q_c, ops.kv_new, ops.q_b_proj,
        q_parts, ops.kv_b_proj, q_lat, ops.kv_cache, stats[0], stats[1], partial, o_lat, ops.o,
        barrier_counter(x.device), batch, heads, q_rank, lora, rope, nope, v_dim, context, eps,
        scale * LOG2E, x.stride(0), q_parts.stride(0), q_b.k_per_split,
        blocks.tokens_per_split, blocks.splits,
    )  # fmt: skip
    constants = {
        "QKV_SPLITS": x.shape[0],
        "Q_SPLITS": q_b.splits,
        "ROWS": rows,
        "BLOCK_Q": triton.next_power_of_2(q_rank),
        "BLOCK_L": triton.next_power_of_2(lora),
        "BLOCK_HALF_R": triton.next_power_of_2(rope // 2),
        "BLOCK_R": triton.next_power_of_2(rope),
        "BLOCK_D": triton.next_power_of_2(lora + rope),
        "BLOCK_NOPE": triton.next_power_of_2(nope),
        "GEMV_M": q_b.block_m,
        "GEMV_N": q_b.block_n,
        "GEMV_K": q_b.block_k,
        "ABSORB_M": ABSORB_ROWS,
        "ABSORB_L": blocks.absorb_cols,
        "BLOCK_H": blocks.block_h,
        "BLOCK_T": blocks.block_t,
        "COMBINE_HEADS": blocks.combine_heads,
        "BLOCK_S": triton.next_power_of_2(blocks.splits),
        "COMBINE_SC": blocks.combine_splits,
        "COMBINE_LC": blocks.combine_cols,
        "UV_M": blocks.block_m,
        "UV_V": blocks.uv_cols,
        "UV_K": min(128, triton.next_power_of_2(lora)),
        "DOT_F32": not x.is_cuda,
        "SPIN": SPIN_LIMIT,
        "num_warps": blocks.split_warps,
        "num_stages": blocks.split_stages,
    }
    constants |= {"PREFETCH": prefetch_weights(x.device), **pdl_options(x.device)}
    if not x.is_cuda or not one_launch:
        _phases_as_launches(args, items, constants)
        return
    constants["PHASE"] = ALL_PHASES
    sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (sm_count * programs_that_fit(args, items, constants, programs_per_sm),)
    _attention_block_kernel[grid](*args, **items, **constants)


def _phases_as_launches(
    args: tuple[object, ...], items: dict[str, int], constants: dict[str, object]
) -> None:
    phase_items = ("prep_items", "q_b_items", "absorb_items", "split_items")
    phase_items += ("combine_items", "uv_items")
    for phase, key in enumerate(phase_items):
        _attention_block_kernel[(items[key],)](*args, **items, **constants, PHASE=phase)


def programs_that_fit(
    args: tuple[object, ...], items: dict[str, int], constants: dict[str, object], wanted: int
) -> int:
    """Programs per SM for the persistent grid: `wanted`, or fewer if the compiled kernel's
    registers or shared memory would not let that many stay resident (a barrier over programs
    that are not resident waits until SPIN_LIMIT)."""
    key = (wanted, *sorted((k, v) for k, v in constants.items() if k not in ("SPIN",)))
    return _fitting(key, args, items, constants, wanted)


_FIT_CACHE: dict[tuple[object, ...], int] = {}
# per compiled persistent kernel: its registers, spills and shared memory (device check JSON)
COMPILED_STATS: dict[tuple[object, ...], dict[str, int]] = {}


def _fitting(
    key: tuple[object, ...],
    args: tuple[object, ...],
    items: dict[str, int],
    constants: dict[str, object],
    wanted: int,
) -> int:
    if key not in _FIT_CACHE:
        device = args[0].device  # type: ignore[attr-defined]
        compiled = _attention_block_kernel.warmup(*args, **items, **constants, grid=(1,))
        compiled._init_handles()  # loads the module: n_regs is known from then on
        props = torch.cuda.get_device_properties(device)
        threads = 32 * int(constants["num_warps"])  # type: ignore[call-overload]
        by_regs = props.regs_per_multiprocessor // max(1, compiled.n_regs * threads)
        shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
        by_shared = shared_per_sm // max(1, compiled.metadata.shared + 1024)
        by_threads = props.max_threads_per_multi_processor // threads
        fits = min(wanted, by_regs, by_shared, by_threads)
        if fits < 1:
            raise RuntimeError("the persistent attention block fits no program on an SM")
        _FIT_CACHE[key] = fits
        COMPILED_STATS[key] = {
            "registers": compiled.n_regs,
            "spills": compiled.n_spills,
            "shared_bytes": compiled.metadata.shared,
            "programs_per_sm": fits,
        }
    return _FIT_CACHE[key]


@functools.lru_cache(maxsize=16)
def barrier_counter(device: torch.device) -> torch.Tensor:
    """The barrier's words on `device` (arrivals, finished, timeouts), zeroed once: built on
    the first call, before any graph capture, and reset by each launch's last program."""
    return torch.zeros(3, device=device, dtype=torch.int32)


def barrier_timeouts(device: torch.device) -> int:
    """How many barrier waits on `device` gave up (SPIN_LIMIT) since the counter was built: a
    check after a run, as a GPU test and the device check read it. Synchronizes."""
    return int(barrier_counter(device)[_TIMEOUTS].item())
