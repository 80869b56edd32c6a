"""The MLA half of the fused decode layer in Triton: everything between fused_qkv_a_proj's GEMV
and o_proj's GEMV. Shapes: B tokens, H heads, Q = q_lora_rank, L = kv_lora_rank, R = rope dim,
N = nope dim, V = v dim; the cache row is L + R wide (latent | roped key).

    latent_prep   fused_qkv_a partials -> q_a_layernorm(q_c) (B, Q) and
                  kv_new = [kv_a_layernorm(kv_c), rope(k_pe)] (B, L+R).  program per token
    q_absorb      q_b partials -> q_lat = [q_nope @ W_UK, rope(q_pe)] (B, H, L+R).
                                            program per (head, L block, block of 16 tokens)
    mla_split     split-KV attention over the cache, all heads per program (MQA over the
                  latent: one read of a cached token serves every head) -> per split its
                  running max, sum and unnormalized output.  program per (token, context split)
    mla_combine   merges the splits by their log-sum-exp and adds the new token
                  -> o_lat (B, H, L).          program per (token, head block, L block)
    w_uv          o = o_lat @ W_UV per head -> (B, H*V), o_proj's input.
                                                                  program per (head, V block)
    combine_w_uv  mla_combine and w_uv in one kernel (fused.LayerPlan.w_uv_in_combine): each
                  program merges one token's head a chunk of L at a time and multiplies it
                  through W_UV.                          program per (token, head, V block)

Precision (ROUNDING in triton_common.py): a value is rounded to bf16 where it leaves as bf16:
q_c, kv_new, the absorbed query, o_lat and o are stored so, q_nope is an MMA operand, and
probabilities are rounded before they multiply the bf16 cache (as FlashMLA and the stock path
do); the GEMVs' sums, the norms and RoPE before those, scores, softmax statistics and
accumulators are fp32. Softmax uses exp2 with
log2(e) folded into the scale. RoPE angles are reduced in fp64 (triton_common.rotate_pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_common import (
    derived_weight,
    mma,
    on_gpu,
    pdl_options,
    rms_normalize,
    rotate_pairs,
    round_bf16,
    rows_per_program,
    sum_splits,
    wait_for_previous_kernel,
)
from kernels.mla_moe_decode.triton_gemv import GemvBlocks

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class AttentionBlocks:
    block_m: int  # >= batch (and >= 16 on the GPU: MMA rows)
    block_h: int  # >= heads (and >= 16 on the GPU)
    block_t: int  # cached tokens per tile of the split kernel
    splits: int  # context splits (programs per token)
    tokens_per_split: int  # a multiple of block_t
    combine_heads: int  # heads per combine program
    combine_splits: int  # splits merged per step of the combine loop
    combine_cols: int  # latent columns per combine program
    absorb_cols: int  # latent columns per q_absorb program
    uv_cols: int  # V columns per w_uv program
    split_warps: int
    split_stages: int
    # warps per program of the three small kernels, as first built (the 2026-12-04 sweeps in
    # docs/benchmarks.md changed none of them)
    absorb_warps: int = 4
    combine_warps: int = 4
    uv_warps: int = 4
    # the split kernel's loads masked per token in every tile, as built before the twentieth
    # session; the GPU plan keeps them above batch 8, where they measured faster
    # (`mla_moe_device_check.py --sweep-small-kernels`)
    mask_every_tile: bool = False
    # V columns per program of the combine that also applies W_UV (combine_w_uv)
    combine_uv_cols: int = 64


# fused_qkv_a partial sums -> q_a_layernorm(q_c), kv_new


@triton.jit
def _latent_prep_kernel(
    part_ptr,  # (splits, B, Q + L + R) fp32: fused_qkv_a_proj partial sums
    q_norm_ptr,  # (Q,) bf16: q_a_layernorm
    kv_norm_ptr,  # (L,) bf16: kv_a_layernorm
    positions_ptr,  # (B,) int64
    turns_ptr,  # (R/2,) fp64: rope frequency / (2 pi)
    q_c_ptr,  # (B, Q) bf16 out
    kv_new_ptr,  # (B, L + R) bf16 out
    N_SPLITS: tl.constexpr,  # sum_splits unrolls over it
    split_stride,
    B,
    Q,
    L,
    R,
    eps,
    ROWS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF_R: tl.constexpr,
    PDL: tl.constexpr,
    squares_ptr,  # INPUT_NORM: (splits, B) fp32, the input's squares per qkv_a split
    D,  # INPUT_NORM: the input's width (hidden)
    input_eps,  # INPUT_NORM: the input norm's eps
    INPUT_NORM: tl.constexpr,  # the partials are of the input not yet divided by its rms
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = (rows < B)[:, None]  # (ROWS, 1)
    base = rows[:, None] * (Q + L + R)  # (ROWS, 1)
    if INPUT_NORM:  # the input RMSNorm's scale, one number per token (summed_gemv)
        squares = sum_splits(squares_ptr, rows[:, None], row_mask, N_SPLITS, B)
        scale = tl.rsqrt(squares / D + input_eps)  # (ROWS, 1)
    else:
        scale = tl.full((ROWS, 1), 1.0, tl.float32)
    qs = tl.arange(0, BLOCK_Q)
    q_mask = row_mask & (qs < Q)[None, :]
    q_c = sum_splits(part_ptr, base + qs[None, :], q_mask, N_SPLITS, split_stride) * scale
    q_weight = tl.load(q_norm_ptr + qs, mask=qs < Q, other=0.0).to(tl.float32)
    q_c = rms_normalize(q_c, Q, eps, q_weight[None, :])
    tl.store(q_c_ptr + rows[:, None] * Q + qs[None, :], q_c, mask=q_mask)
    _kv_new_rows(
        part_ptr, kv_norm_ptr, positions_ptr, turns_ptr, kv_new_ptr, rows, N_SPLITS,
        split_stride, B, Q, L, R, eps, BLOCK_L, BLOCK_HALF_R, scale,
    )  # fmt: skip


@triton.jit
def _kv_new_rows(
    part_ptr,  # (splits, B, Q + L + R) fp32: fused_qkv_a_proj partial sums
    kv_norm_ptr,
    positions_ptr,
    turns_ptr,
    kv_new_ptr,  # (B, L + R) bf16 out
    rows,  # (ROWS,) the tokens
    N_SPLITS: tl.constexpr,
    split_stride,
    B,
    Q,
    L,
    R,
    eps,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF_R: tl.constexpr,
    scale,  # (ROWS, 1) fp32: what the partials' sums are multiplied by first
):
    """kv_new of some tokens: [kv_a_layernorm(kv_c), rope(k_pe)] from the qkv_a partials."""
    row_mask = (rows < B)[:, None]  # (ROWS, 1)
    base = rows[:, None] * (Q + L + R)  # (ROWS, 1)
    out_row = kv_new_ptr + rows[:, None] * (L + R)  # (ROWS, 1)
    ls = tl.arange(0, BLOCK_L)
    l_mask = row_mask & (ls < L)[None, :]
    kv_c = sum_splits(part_ptr, base + Q + ls[None, :], l_mask, N_SPLITS, split_stride) * scale
    kv_weight = tl.load(kv_norm_ptr + ls, mask=ls < L, other=0.0).to(tl.float32)
    kv_c = rms_normalize(kv_c, L, eps, kv_weight[None, :])
    tl.store(out_row + ls[None, :], kv_c, mask=l_mask)

    pairs = tl.arange(0, BLOCK_HALF_R)
    pair_mask = row_mask & (pairs < R // 2)[None, :]
    even_at = base + Q + L + 2 * pairs[None, :]
    even = sum_splits(part_ptr, even_at, pair_mask, N_SPLITS, split_stride) * scale
    odd = sum_splits(part_ptr, even_at + 1, pair_mask, N_SPLITS, split_stride) * scale
    positions = tl.load(positions_ptr + rows, mask=rows < B, other=0).to(tl.float64)
    freqs = tl.load(turns_ptr + pairs, mask=pairs < R // 2, other=0.0)
    even, odd = rotate_pairs(even, odd, positions[:, None] * freqs[None, :])
    tl.store(out_row + L + 2 * pairs[None, :], round_bf16(even), mask=pair_mask)
    tl.store(out_row + L + 2 * pairs[None, :] + 1, round_bf16(odd), mask=pair_mask)


def latent_prep(
    parts: torch.Tensor,
    q_norm: torch.Tensor,
    kv_norm: torch.Tensor,
    positions: torch.Tensor,
    turns: torch.Tensor,
    q_c: torch.Tensor,
    kv_new: torch.Tensor,
    eps: float,
    num_warps: int = 4,
    input_norm: DeferredNorm | None = None,
) -> None:
    """parts (splits, B, Q+L+R) fp32 -> q_c (B, Q) and kv_new (B, L+R), both bf16. With
    `input_norm` (from triton_gemv.summed_gemv or cute_gemv's summed mode) the partials are of
    the input not yet divided by its rms: each token's sums are divided by it first."""
    n_splits, batch, _ = parts.shape
    q_rank, lora = q_c.shape[1], kv_norm.shape[0]
    rope = kv_new.shape[1] - lora
    rows = rows_per_program(batch, on_gpu(parts))
    _latent_prep_kernel[(triton.cdiv(batch, rows),)](
        parts,
        q_norm,
        kv_norm,
        positions,
        turns,
        q_c,
        kv_new,
        n_splits,
        parts.stride(0),
        batch,
        q_rank,
        lora,
        rope,
        eps,
        ROWS=rows,
        BLOCK_Q=triton.next_power_of_2(q_rank),
        BLOCK_L=triton.next_power_of_2(lora),
        BLOCK_HALF_R=triton.next_power_of_2(rope // 2),
        num_warps=num_warps,
        **pdl_options(parts.device),
        squares_ptr=parts if input_norm is None else input_norm.squares,
        D=input_norm.width if input_norm else 1,
        input_eps=input_norm.eps if input_norm else 0.0,
        INPUT_NORM=input_norm is not None,
    )


# Pipeline stages of the folded q_b GEMV: a K step holds qkv_a's splits of q_a (8 x 16 x 64
# fp32 at batch <= 16) besides the weight tile, so q_b's 4 stages took 120 KB of shared memory
# and one program per SM (sm90_compile.py, Triton 3.9); 3 take 80 KB, two per SM.
FOLDED_STAGES = 3


# fused_qkv_a partials -> q_b partials and kv_new in one launch: latent_prep folded into q_b
#
# q_a_layernorm's scale is one number per token, so it commutes with q_b_proj:
# W @ (q_a * rstd * g) = rstd * (W @ (q_a * g)). The GEMV's programs add the qkv_a splits of
# their own K range of q_a, multiply by the norm weight g, round once (the MMA's bf16 operand,
# where the unfolded path rounds q_c) and also sum q_a^2 over that range; q_absorb divides by
# the rms when it adds q_b's splits. The kv half of latent_prep runs as extra programs of the
# same launch. One dependent kernel fewer (LayerPlan.fold_latent_prep; off until measured).


@dataclass(frozen=True)
class DeferredNorm:
    """A GEMV's partial sums were computed from x * (an RMSNorm's weight), x not yet divided by
    its rms: squares (splits, B) fp32, each K split's sum of x^2; x's width; the norm's eps.
    q_b's over q_a (q_b_folded), qkv_a's over the layer's input (summed_gemv)."""

    squares: torch.Tensor
    width: int
    eps: float


@triton.jit
def _q_b_folded_kernel(
    part_ptr,  # (S_a, B, Q + L + R) fp32: fused_qkv_a_proj partial sums
    q_norm_ptr,  # (Q,) bf16
    kv_norm_ptr,  # (L,) bf16
    positions_ptr,  # (B,) int64
    turns_ptr,  # (R/2,) fp64
    w_ptr,  # (N, Q) bf16: q_b_proj
    out_ptr,  # (S, B, N) fp32 out: partial sums of (q_a * q_norm) @ W.T
    squares_ptr,  # (S, B) fp32 out: each K split's sum of q_a^2
    kv_new_ptr,  # (B, L + R) bf16 out
    N_SPLITS: tl.constexpr,  # qkv_a's splits (sum_splits unrolls over them)
    split_stride,
    B,
    N,
    Q,
    L,
    R,
    eps,
    k_per_split,
    ROWS: tl.constexpr,  # tokens per kv program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF_R: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    block = tl.program_id(0)
    split = tl.program_id(1)
    column_blocks = tl.cdiv(N, BLOCK_N)
    if block >= column_blocks:  # the kv half of latent_prep: ROWS tokens per program
        # (not `rows`: a name assigned in both branches must have one type for the compiler)
        group = (block - column_blocks) * tl.num_programs(1) + split
        tokens = group * ROWS + tl.arange(0, ROWS)
        _kv_new_rows(
            part_ptr, kv_norm_ptr, positions_ptr, turns_ptr, kv_new_ptr, tokens, N_SPLITS,
            split_stride, B, Q, L, R, eps, BLOCK_L, BLOCK_HALF_R,
            tl.full((ROWS, 1), 1.0, tl.float32),
        )  # fmt: skip
    else:
        rows = tl.arange(0, BLOCK_M)
        row_mask = rows < B
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_rows = w_ptr + tl.minimum(cols, N - 1)[:, None] * Q  # (BLOCK_N, 1)
        k_start = split * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k_offset in range(0, k_per_split, BLOCK_K):
            ks = k_start + k_offset + tl.arange(0, BLOCK_K)
            k_mask = ks < Q
            q_a = sum_splits(
                part_ptr,
                rows[:, None] * (Q + L + R) + ks[None, :],
                row_mask[:, None] & k_mask[None, :],
                N_SPLITS,
                split_stride,
            )  # (BLOCK_M, BLOCK_K) fp32: rows past B and columns past Q are 0
            squares += tl.sum(q_a * q_a, axis=1)
            weight = tl.load(q_norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = round_bf16(q_a * weight[None, :])
            w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc = mma(x, tl.trans(w), acc, DOT_F32)
        out = out_ptr + split * B * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])
        if block == 0:
            tl.store(squares_ptr + split * B + rows, squares, mask=row_mask)


def q_b_folded(
    parts: torch.Tensor,
    q_norm: torch.Tensor,
    kv_norm: torch.Tensor,
    positions: torch.Tensor,
    turns: torch.Tensor,
    q_b_proj: torch.Tensor,
    kv_new: torch.Tensor,
    eps: float,
    blocks: GemvBlocks,
) -> tuple[torch.Tensor, DeferredNorm]:
    """parts (S_a, B, Q+L+R) fp32 -> (q_b partial sums (S, B, N) fp32 of (q_a * q_norm) @ W.T,
    the DeferredNorm q_absorb divides by), and kv_new (B, L+R) bf16 as latent_prep writes it.
    The GEMV's tiles are q_b's plan's, with K steps cut so that a step's qkv_a partials (S_a
    tiles of block_m x block_k fp32, loaded at once) stay about 64 values per thread."""
    n_splits, batch, _ = parts.shape
    n, q_rank = q_b_proj.shape
    lora = kv_norm.shape[0]
    rope = kv_new.shape[1] - lora
    block_k = min(blocks.block_k, max(16, 1024 // blocks.block_m))
    if blocks.k_per_split % block_k:
        raise ValueError(f"q_b_folded: K per split {blocks.k_per_split} not in steps of {block_k}")
    rows = rows_per_program(batch, on_gpu(parts))
    out = torch.empty(blocks.splits, batch, n, device=parts.device, dtype=torch.float32)
    squares = torch.empty(blocks.splits, batch, device=parts.device, dtype=torch.float32)
    kv_blocks = triton.cdiv(triton.cdiv(batch, rows), blocks.splits)  # over every split
    grid = (triton.cdiv(n, blocks.block_n) + kv_blocks, blocks.splits)
    _q_b_folded_kernel[grid](
        parts,
        q_norm,
        kv_norm,
        positions,
        turns,
        q_b_proj,
        out,
        squares,
        kv_new,
        n_splits,
        parts.stride(0),
        batch,
        n,
        q_rank,
        lora,
        rope,
        eps,
        blocks.k_per_split,
        ROWS=rows,
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=block_k,
        BLOCK_L=triton.next_power_of_2(lora),
        BLOCK_HALF_R=triton.next_power_of_2(rope // 2),
        DOT_F32=not on_gpu(parts),
        num_warps=blocks.num_warps,
        num_stages=min(blocks.num_stages, FOLDED_STAGES),
        **pdl_options(parts.device),
    )
    return out, DeferredNorm(squares, q_rank, eps)


# q_b partial sums -> absorbed, roped query

# Tokens per q_absorb program: the MMA's least. With the whole batch in one program, batch 64
# held 64 x 128 fp32 of q_nope per q_b split (the splits are summed unrolled) and the kernel
# took 46 µs on the H200 against 4.7 at batch 1 (docs/mla_moe_notes.md, ninth session).
ABSORB_ROWS = 16


@triton.jit
def _q_absorb_kernel(
    part_ptr,  # (splits, B, H * (N + R)) fp32: q_b_proj partial sums
    kv_b_ptr,  # (H * (N + V), L) bf16: per head [W_UK (N rows); W_UV (V rows)]
    positions_ptr,  # (B,) int64
    turns_ptr,  # (R/2,) fp64
    q_lat_ptr,  # (B, H, L + R) bf16 out
    N_SPLITS: tl.constexpr,  # sum_splits unrolls over it
    split_stride,
    B,
    H,
    NOPE,
    R,
    V,
    L,
    BLOCK_M: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_HALF_R: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    squares_ptr,  # DEFERRED_NORM: (splits, B) fp32, each q_b split's sum of q_a^2
    Q,  # DEFERRED_NORM: q_a's width
    eps,  # DEFERRED_NORM: q_a_layernorm's eps
    DEFERRED_NORM: tl.constexpr,  # q_b's partials are of q_a * weight: divide by q_a's rms
):
    wait_for_previous_kernel(PDL)
    head = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < B
    q_row = rows[:, None] * (H * (NOPE + R)) + head * (NOPE + R)  # (BLOCK_M, 1)
    ns = tl.arange(0, BLOCK_NOPE)
    nope_mask = row_mask[:, None] & (ns < NOPE)[None, :]
    q_nope = sum_splits(part_ptr, q_row + ns[None, :], nope_mask, N_SPLITS, split_stride)
    scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if DEFERRED_NORM:  # the folded latent_prep's rms (q_b_folded): splits added in order
        mean_square = sum_splits(squares_ptr, rows, row_mask, N_SPLITS, B) / Q
        scale = tl.rsqrt(mean_square + eps)
        q_nope = q_nope * scale[:, None]
    q_nope = round_bf16(q_nope)  # (BLOCK_M, BLOCK_NOPE): q_b_proj's bf16 output
    ls = col_block * BLOCK_L + tl.arange(0, BLOCK_L)
    l_mask = ls < L
    w_uk = tl.load(
        kv_b_ptr + (head * (NOPE + V) + ns)[:, None] * L + ls[None, :],
        mask=(ns < NOPE)[:, None] & l_mask[None, :],
        other=0.0,
    )  # (BLOCK_NOPE, BLOCK_L)
    absorbed = mma(q_nope, w_uk, tl.zeros((BLOCK_M, BLOCK_L), dtype=tl.float32), DOT_F32)
    out_row = q_lat_ptr + rows[:, None] * (H * (L + R)) + head * (L + R)  # (BLOCK_M, 1)
    tl.store(out_row + ls[None, :], round_bf16(absorbed), mask=row_mask[:, None] & l_mask[None, :])
    if col_block == 0:
        pairs = tl.arange(0, BLOCK_HALF_R)
        pair_mask = row_mask[:, None] & (pairs < R // 2)[None, :]
        even_at = q_row + NOPE + 2 * pairs[None, :]
        even = sum_splits(part_ptr, even_at, pair_mask, N_SPLITS, split_stride)
        odd = sum_splits(part_ptr, even_at + 1, pair_mask, N_SPLITS, split_stride)
        if DEFERRED_NORM:
            even, odd = even * scale[:, None], odd * scale[:, None]
        positions = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.float64)
        freqs = tl.load(turns_ptr + pairs, mask=pairs < R // 2, other=0.0)
        even, odd = rotate_pairs(even, odd, positions[:, None] * freqs[None, :])
        pe_at = out_row + L + 2 * pairs[None, :]
        tl.store(pe_at, round_bf16(even), mask=pair_mask)
        tl.store(pe_at + 1, round_bf16(odd), mask=pair_mask)


def q_absorb(
    parts: torch.Tensor,
    kv_b_proj: torch.Tensor,
    positions: torch.Tensor,
    turns: torch.Tensor,
    q_lat: torch.Tensor,
    nope: int,
    v_dim: int,
    blocks: AttentionBlocks,
    deferred: DeferredNorm | None = None,
) -> None:
    """parts (splits, B, H*(N+R)) fp32 -> q_lat (B, H, L+R) bf16. With `deferred` (from
    q_b_folded) each token's q is divided by q_a's rms first."""
    n_splits, batch, _ = parts.shape
    _, heads, width = q_lat.shape
    lora = kv_b_proj.shape[1]
    rope = width - lora
    grid = (heads, triton.cdiv(lora, blocks.absorb_cols), triton.cdiv(batch, ABSORB_ROWS))
    _q_absorb_kernel[grid](
        parts,
        kv_b_proj,
        positions,
        turns,
        q_lat,
        n_splits,
        parts.stride(0),
        batch,
        heads,
        nope,
        rope,
        v_dim,
        lora,
        BLOCK_M=ABSORB_ROWS,
        BLOCK_NOPE=triton.next_power_of_2(nope),
        BLOCK_L=blocks.absorb_cols,
        BLOCK_HALF_R=triton.next_power_of_2(rope // 2),
        DOT_F32=not on_gpu(parts),
        num_warps=blocks.absorb_warps,
        squares_ptr=parts if deferred is None else deferred.squares,
        Q=deferred.width if deferred else 1,
        eps=deferred.eps if deferred else 0.0,
        DEFERRED_NORM=deferred is not None,
        **pdl_options(parts.device),
    )


# split-KV latent attention


@triton.jit
def _mla_split_kernel(
    q_lat_ptr,  # (B, H, L + R) bf16; FINISH_Q: out, written by each token's split 0
    cache_ptr,  # (B, T, L + R) bf16
    max_ptr,  # (B, S, H) fp32 out: running max of the scaled log2 scores
    sum_ptr,  # (B, S, H) fp32 out: sum of exp2(score - max)
    acc_ptr,  # (B, S, H, L) fp32 out: sum of bf16(exp2(score - max)) * latent
    T,
    H,
    L,
    R,
    tokens_per_split,
    scale_log2,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr,
    PDL: tl.constexpr,
    q_sums_ptr,  # FINISH_Q: (B, H, L + R) fp32, the absorbed query GEMV's sums
    positions_ptr,  # FINISH_Q: (B,) int64
    turns_ptr,  # FINISH_Q: (R/2,) fp64
    FINISH_Q: tl.constexpr,  # q_lat from q_sums: RoPE on the last R, rounded, as q_absorb's
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    width = L + R
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < H
    ls = tl.arange(0, BLOCK_L)
    l_mask = ls < L
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    q_row = q_lat_ptr + row * H * width + heads[:, None] * width  # (BLOCK_H, 1)
    if FINISH_Q:
        q_latent, q_rope = _finished_query(
            q_sums_ptr, positions_ptr, turns_ptr, q_row, row, heads, head_mask, ls, l_mask, H,
            L, R, split == 0, BLOCK_H, BLOCK_R,
        )  # fmt: skip
    else:
        q_latent = tl.load(
            q_row + ls[None, :], mask=head_mask[:, None] & l_mask[None, :], other=0.0
        )
        q_rope = tl.load(
            q_row + L + rs[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0
        )
    cache_row = cache_ptr + row.to(tl.int64) * T * width
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, T)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for tile in range(start, end, BLOCK_T):
        tokens = tile + tl.arange(0, BLOCK_T)
        t_mask = tokens < end
        if MASK_EVERY_TILE:  # the loads as built before the twentieth session
            token_at = cache_row + tokens[:, None] * width  # (BLOCK_T, 1)
            load_l = t_mask[:, None] & l_mask[None, :]
            load_r = t_mask[:, None] & r_mask[None, :]
        else:
            # Tokens past the split's end read its last token again (scored -inf below), so
            # the loads need no token mask. Masked, they took a predicate per token wherever
            # the context is not a multiple of 16 (Triton specializes T when it is, and the
            # mask is then provably constant over 16 tokens): at batch 8 x 22759 this kernel
            # read 2.8 TB/s against 4.2 at 8 x 32768 (the twentieth session's profile,
            # docs/benchmarks.md, "The gate_up's rounds ... off-grid contexts").
            token_at = cache_row + tl.minimum(tokens, end - 1)[:, None] * width
            load_l = l_mask[None, :]
            load_r = r_mask[None, :]
        k_latent = tl.load(token_at + ls[None, :], mask=load_l, other=0.0)
        k_rope = tl.load(token_at + L + rs[None, :], mask=load_r, other=0.0)
        scores = mma(
            q_latent, tl.trans(k_latent), tl.zeros((BLOCK_H, BLOCK_T), tl.float32), DOT_F32
        )
        scores = mma(q_rope, tl.trans(k_rope), scores, DOT_F32) * scale_log2  # (BLOCK_H, BLOCK_T)
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = mma(round_bf16(probs), k_latent, acc * rescale[:, None], DOT_F32)
        running_max = new_max
    stat_at = (row * n_splits + split) * H + heads
    tl.store(max_ptr + stat_at, running_max, mask=head_mask)
    tl.store(sum_ptr + stat_at, running_sum, mask=head_mask)
    acc_at = acc_ptr + stat_at[:, None] * L + ls[None, :]
    tl.store(acc_at, acc, mask=head_mask[:, None] & l_mask[None, :])


@triton.jit
def _finished_query(
    q_sums_ptr,
    positions_ptr,
    turns_ptr,
    q_row,  # (BLOCK_H, 1) pointers to each head's q_lat row
    row,
    heads,
    head_mask,
    ls,
    l_mask,
    H,
    L,
    R,
    store,  # this program writes q_lat (one per token: the combine reads it)
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The query from the absorbed GEMV's fp32 sums (absorbed_q_weight): the latent part
    rounded, the rope part rotated and rounded, as q_absorb stores them: (q_latent (BLOCK_H,
    BLOCK_L), q_rope (BLOCK_H, BLOCK_R)) bf16, the rope part interleaved as in the cache."""
    width = L + R
    sums_row = q_sums_ptr + row * H * width + heads[:, None] * width  # (BLOCK_H, 1)
    latent_mask = head_mask[:, None] & l_mask[None, :]
    q_latent = round_bf16(tl.load(sums_row + ls[None, :], mask=latent_mask, other=0.0))
    pairs = tl.arange(0, BLOCK_R // 2)
    pair_mask = head_mask[:, None] & (pairs < R // 2)[None, :]
    even_at = sums_row + L + 2 * pairs[None, :]
    even = tl.load(even_at, mask=pair_mask, other=0.0)
    odd = tl.load(even_at + 1, mask=pair_mask, other=0.0)
    position = tl.load(positions_ptr + row).to(tl.float64)
    freqs = tl.load(turns_ptr + pairs, mask=pairs < R // 2, other=0.0)
    even, odd = rotate_pairs(even, odd, position * freqs[None, :])
    even, odd = round_bf16(even), round_bf16(odd)
    if store:
        tl.store(q_row + ls[None, :], q_latent, mask=latent_mask)
        tl.store(q_row + L + 2 * pairs[None, :], even, mask=pair_mask)
        tl.store(q_row + L + 2 * pairs[None, :] + 1, odd, mask=pair_mask)
    q_rope = tl.reshape(tl.join(even, odd), (BLOCK_H, BLOCK_R))  # [e0, o0, e1, o1, ...]
    return q_latent, q_rope


@triton.jit
def _mla_combine_kernel(
    max_ptr,  # (B, S, H) fp32
    sum_ptr,  # (B, S, H) fp32
    acc_ptr,  # (B, S, H, L) fp32
    q_lat_ptr,  # (B, H, L + R) bf16
    kv_new_ptr,  # (B, L + R) bf16
    o_ptr,  # (B, H, L) out: bf16 attention (FINAL), else fp32 unnormalized sum of the splits
    merged_max_ptr,  # (B, H) fp32 out unless FINAL: the splits' merged running max
    merged_sum_ptr,  # (B, H) fp32 out unless FINAL: their merged sum
    n_splits,
    H,
    L,
    R,
    scale_log2,
    HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SC: tl.constexpr,
    BLOCK_LC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FINAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """FINAL: the splits and the new token, normalized, as bf16 (the attention). Otherwise one
    decode-CP rank's splits merged into a single split (max, sum, fp32 sum of the rescaled
    partials), without the new token: the ranks' merged splits are then combined with FINAL."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # (HEADS,)
    head_mask = heads < H
    col_block = tl.program_id(2)
    width = L + R
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < width
    q = tl.load(
        q_lat_ptr + (row * H + heads)[:, None] * width + ds[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # (HEADS, BLOCK_D)
    k_new = tl.load(kv_new_ptr + row * width + ds, mask=d_mask, other=0.0).to(tl.float32)
    score_new = tl.sum(q * k_new[None, :], axis=1) * scale_log2  # (HEADS,)
    splits = tl.arange(0, BLOCK_S)
    stat_at = (row * n_splits + splits)[:, None] * H + heads[None, :]  # (BLOCK_S, HEADS)
    stat_mask = (splits < n_splits)[:, None] & head_mask[None, :]
    split_max = tl.load(max_ptr + stat_at, mask=stat_mask, other=float("-inf"))
    split_sum = tl.load(sum_ptr + stat_at, mask=stat_mask, other=0.0)
    if FINAL:
        total_max = tl.maximum(tl.max(split_max, axis=0), score_new)  # (HEADS,)
    else:  # a rank without tokens has only -inf maxima: rescale from 0, not from -inf
        total_max = tl.max(split_max, axis=0)
        total_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight_new = tl.exp2(score_new - total_max)
    total = tl.sum(tl.exp2(split_max - total_max[None, :]) * split_sum, axis=0)
    ls = col_block * BLOCK_LC + tl.arange(0, BLOCK_LC)
    l_mask = ls < L
    out = tl.zeros((HEADS, BLOCK_LC), dtype=tl.float32)
    for first in range(0, n_splits, BLOCK_SC):
        chunk = first + tl.arange(0, BLOCK_SC)
        chunk_at = (row * n_splits + chunk)[:, None] * H + heads[None, :]  # (BLOCK_SC, HEADS)
        chunk_mask = (chunk < n_splits)[:, None] & head_mask[None, :]
        chunk_max = tl.load(max_ptr + chunk_at, mask=chunk_mask, other=float("-inf"))
        partial = tl.load(
            acc_ptr + chunk_at[:, :, None] * L + ls[None, None, :],
            mask=chunk_mask[:, :, None] & l_mask[None, None, :],
            other=0.0,
        )  # (BLOCK_SC, HEADS, BLOCK_LC)
        rescale = tl.exp2(chunk_max - total_max[None, :])  # (BLOCK_SC, HEADS)
        out += tl.sum(rescale[:, :, None] * partial, axis=0)
    out_at = o_ptr + (row * H + heads)[:, None] * L + ls[None, :]
    if FINAL:
        latent_new = tl.load(kv_new_ptr + row * width + ls, mask=l_mask, other=0.0)
        out += weight_new[:, None] * latent_new.to(tl.float32)[None, :]
        out = out / (total + weight_new)[:, None]
        tl.store(out_at, round_bf16(out), mask=head_mask[:, None] & l_mask[None, :])
    else:
        tl.store(out_at, out, mask=head_mask[:, None] & l_mask[None, :])
        if col_block == 0:  # one column block writes the statistics
            merged_at = row * H + heads
            tl.store(merged_max_ptr + merged_at, tl.max(split_max, axis=0), mask=head_mask)
            tl.store(merged_sum_ptr + merged_at, total, mask=head_mask)


@dataclass(frozen=True)
class UnfinishedQuery:
    """The query as the absorbed GEMV leaves it (absorbed_q_weight): fp32 sums, the rope part
    not yet rotated. The split kernel finishes it into q_lat as q_absorb would have."""

    sums: torch.Tensor  # (1, B, H * (L + R)) fp32: the GEMV's one split
    positions: torch.Tensor  # (B,) int64
    turns: torch.Tensor  # (R/2,) fp64: rope_turns


def mla_attention(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_new: torch.Tensor,
    o_lat: torch.Tensor,
    scale: float,
    blocks: AttentionBlocks,
    unfinished: UnfinishedQuery | None = None,
) -> None:
    """q_lat (B, H, L+R), kv_cache (B, T, L+R), kv_new (B, L+R) bf16 -> o_lat (B, H, L) bf16:
    softmax(q . [cache; new] * scale) @ [cache; new][:, :L], the split kernel then the combine.
    With `unfinished` the split kernel first finishes q_lat from it (and writes it)."""
    stats, partial = _split_partials(q_lat, kv_cache, o_lat.shape[2], scale, blocks, unfinished)
    _combine(stats, partial, q_lat, kv_new, o_lat, None, scale, blocks)


def mla_attention_w_uv(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_new: torch.Tensor,
    kv_b_proj: torch.Tensor,
    o: torch.Tensor,
    nope: int,
    scale: float,
    blocks: AttentionBlocks,
    unfinished: UnfinishedQuery | None = None,
) -> None:
    """mla_attention then w_uv as two kernels: the split kernel, then combine_w_uv -> o
    (B, H*V) bf16, o_proj's input."""
    lora = kv_b_proj.shape[1]
    stats, partial = _split_partials(q_lat, kv_cache, lora, scale, blocks, unfinished)
    combine_w_uv(stats, partial, q_lat, kv_new, kv_b_proj, o, nope, scale, blocks)


def absorbed_q_weight(
    q_b_proj: torch.Tensor, kv_b_proj: torch.Tensor, heads: int, nope: int, v_dim: int
) -> torch.Tensor:
    """q_b_proj (H (N + R), Q) and kv_b_proj (H (N + V), L) -> (H (L + R), Q) bf16: per head
    W_UK^T @ W_q_nope (L rows, multiplied in fp32 and rounded once), then the head's q_pe
    rows as they are. q_c @ it.T is q_lat before RoPE: q_b_proj and q_absorb's W_UK product as
    one GEMV over a weight 2.9 times q_b_proj's size (vLLM's MLA once did the same,
    VLLM_MLA_PERFORM_MATRIX_ABSORPTION). The cached result (absorbed_q_weights) is what the
    layer reads."""
    q_lora = q_b_proj.shape[1]
    lora = kv_b_proj.shape[1]
    q_b = q_b_proj.view(heads, -1, q_lora).float()  # (H, N + R, Q)
    w_uk = kv_b_proj.view(heads, nope + v_dim, lora)[:, :nope].float()  # (H, N, L)
    latent = torch.einsum("hnl,hnq->hlq", w_uk, q_b[:, :nope])  # (H, L, Q)
    return torch.cat([latent, q_b[:, nope:]], dim=1).to(q_b_proj.dtype).reshape(-1, q_lora)


def absorbed_q_weights(
    q_b_proj: torch.Tensor, kv_b_proj: torch.Tensor, heads: int, nope: int, v_dim: int
) -> torch.Tensor:
    """absorbed_q_weight, computed once per pair of weight tensors (triton_common.derived_weight:
    again if either is written in place, kept while both live)."""
    return derived_weight(absorbed_q_weight, (q_b_proj, kv_b_proj), heads, nope, v_dim)


# torch 2.13 renamed it (the old name warns); the GPU machines run torch 2.11
_all_gather_into_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def mla_attention_cp(
    q_lat: torch.Tensor,
    kv_slice: torch.Tensor,
    kv_new: torch.Tensor,
    o_lat: torch.Tensor,
    scale: float,
    blocks: AttentionBlocks,
    group: dist.ProcessGroup,
) -> None:
    """Decode context parallelism: as mla_attention, on one rank of `group` holding its slice
    (B, T_r, L+R) of the cache. This rank's splits merge into one (max, sum, partial), the
    group all-gathers those (one collective), and every rank combines the ranks' merged splits
    with the new token as mla_attention combines its own: the same arithmetic, its splits
    grouped by rank. Collective: every rank of the group calls it."""
    packed = rank_merged_split(q_lat, kv_slice, kv_new, o_lat.shape[2], scale, blocks)
    world = dist.get_world_size(group)
    gathered = packed.new_empty(world * packed.shape[0], *packed.shape[1:])
    _all_gather_into_tensor(gathered, packed, group=group)  # rank-major: (cp * B, H, L + 2)
    combine_rank_splits(gathered.view(world, *packed.shape), q_lat, kv_new, o_lat, scale, blocks)


def rank_merged_split(
    q_lat: torch.Tensor,
    kv_slice: torch.Tensor,
    kv_new: torch.Tensor,
    lora: int,
    scale: float,
    blocks: AttentionBlocks,
) -> torch.Tensor:
    """One decode-CP rank's share: its slice's splits merged into one, packed as (B, H, L + 2)
    fp32 (the partial, then its max and sum) so that one collective gathers them. The new
    token is left out: the final combine adds it once."""
    batch, heads, _ = q_lat.shape
    stats, partial = _split_partials(q_lat, kv_slice, lora, scale, blocks)
    merged = torch.empty(2, batch, heads, device=q_lat.device, dtype=torch.float32)
    merged_partial = torch.empty(batch, heads, lora, device=q_lat.device, dtype=torch.float32)
    _combine(stats, partial, q_lat, kv_new, merged_partial, (merged[0], merged[1]), scale, blocks)
    return torch.cat([merged_partial, merged.permute(1, 2, 0)], -1)


def combine_rank_splits(
    ranks: torch.Tensor,
    q_lat: torch.Tensor,
    kv_new: torch.Tensor,
    o_lat: torch.Tensor,
    scale: float,
    blocks: AttentionBlocks,
) -> None:
    """The group's merged splits (cp, B, H, L + 2), rank-major as the all_gather leaves them
    -> o_lat (B, H, L) bf16: the combine kernel over the ranks as over one GPU's splits,
    adding the new token once."""
    lora = o_lat.shape[2]
    rank_stats = ranks[..., lora:].permute(3, 1, 0, 2).contiguous()  # (2, B, cp, H)
    rank_partials = ranks[..., :lora].transpose(0, 1).contiguous()  # (B, cp, H, L)
    _combine(rank_stats, rank_partials, q_lat, kv_new, o_lat, None, scale, blocks)


def _split_partials(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    lora: int,
    scale: float,
    blocks: AttentionBlocks,
    unfinished: UnfinishedQuery | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel: per split, (max, sum) as stats (2, B, S, H) and the partial sums
    (B, S, H, L), all fp32. With `unfinished` it writes q_lat from it first."""
    batch, heads, width = q_lat.shape
    context = kv_cache.shape[1]
    splits = blocks.splits
    stats = torch.empty(2, batch, splits, heads, device=q_lat.device, dtype=torch.float32)
    partial = torch.empty(batch, splits, heads, lora, device=q_lat.device, dtype=torch.float32)
    _mla_split_kernel[(batch, splits)](
        q_lat,
        kv_cache,
        stats[0],
        stats[1],
        partial,
        context,
        heads,
        lora,
        width - lora,
        blocks.tokens_per_split,
        scale * LOG2E,
        BLOCK_H=blocks.block_h,
        BLOCK_T=blocks.block_t,
        BLOCK_L=triton.next_power_of_2(lora),
        BLOCK_R=triton.next_power_of_2(width - lora),
        DOT_F32=not on_gpu(q_lat),
        MASK_EVERY_TILE=blocks.mask_every_tile,
        num_warps=blocks.split_warps,
        num_stages=blocks.split_stages,
        **pdl_options(q_lat.device),
        q_sums_ptr=unfinished.sums if unfinished else q_lat,
        positions_ptr=unfinished.positions if unfinished else q_lat,
        turns_ptr=unfinished.turns if unfinished else q_lat,
        FINISH_Q=unfinished is not None,
    )
    return stats, partial


def _combine(
    stats: torch.Tensor,
    partial: torch.Tensor,
    q_lat: torch.Tensor,
    kv_new: torch.Tensor,
    out: torch.Tensor,
    merged: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    blocks: AttentionBlocks,
) -> None:
    """The combine kernel over the splits of `partial`: the attention into `out` (bf16) when
    `merged` is None; else one rank's merged split, its partial into `out` (fp32) and its
    (max, sum) into `merged`."""
    batch, splits, heads, lora = partial.shape
    width = q_lat.shape[2]
    grid = (batch, triton.cdiv(heads, blocks.combine_heads), triton.cdiv(lora, blocks.combine_cols))
    merged_max, merged_sum = merged if merged is not None else (stats[0], stats[1])
    _mla_combine_kernel[grid](
        stats[0],
        stats[1],
        partial,
        q_lat,
        kv_new,
        out,
        merged_max,
        merged_sum,
        splits,
        heads,
        lora,
        width - lora,
        scale * LOG2E,
        HEADS=blocks.combine_heads,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_SC=blocks.combine_splits,
        BLOCK_LC=blocks.combine_cols,
        BLOCK_D=triton.next_power_of_2(width),
        FINAL=merged is None,
        num_warps=blocks.combine_warps,
        **pdl_options(stats[0].device),
    )


# the combine and W_UV in one kernel: o = combine(splits) @ W_UV per head


@triton.jit
def _combine_w_uv_kernel(
    max_ptr,  # (B, S, H) fp32
    sum_ptr,  # (B, S, H) fp32
    acc_ptr,  # (B, S, H, L) fp32
    q_lat_ptr,  # (B, H, L + R) bf16
    kv_new_ptr,  # (B, L + R) bf16
    kv_b_ptr,  # (H * (N + V), L) bf16
    o_ptr,  # (B, H * V) bf16 out
    n_splits,
    H,
    NOPE,
    V,
    L,
    R,
    scale_log2,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (token, head, V block): the combine's attention row (_mla_combine_kernel's FINAL
    math, the splits merged by their log-sum-exp with the new token), BLOCK_K latent columns
    of every split at a time, each chunk rounded to bf16 as the combine stores o_lat, then
    through the head's W_UV rows of this V block as _w_uv_kernel multiplies it. o_lat never
    leaves the program: one kernel and one dependent round trip fewer than the combine then
    w_uv. A chunk's loads do not depend on the one before, so the loop pipelines."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    width = L + R
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < width
    q = tl.load(q_lat_ptr + (row * H + head) * width + ds, mask=d_mask, other=0.0)
    k_new = tl.load(kv_new_ptr + row * width + ds, mask=d_mask, other=0.0)
    score_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=0) * scale_log2
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < n_splits
    stat_at = (row * n_splits + splits) * H + head
    split_max = tl.load(max_ptr + stat_at, mask=s_mask, other=float("-inf"))
    split_sum = tl.load(sum_ptr + stat_at, mask=s_mask, other=0.0)
    total_max = tl.maximum(tl.max(split_max, axis=0), score_new)
    weight_new = tl.exp2(score_new - total_max)
    rescale = tl.exp2(split_max - total_max)  # (BLOCK_S,), 0 past the splits
    total = tl.sum(rescale * split_sum, axis=0)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < V
    w_rows = kv_b_ptr + (head * (NOPE + V) + NOPE + vs)[:, None] * L  # (BLOCK_V, 1)
    new_row = kv_new_ptr + row * width
    partials = acc_ptr + stat_at[:, None] * L  # (BLOCK_S, 1)
    # Each chunk's loads are issued before the chunk before it is computed: two chunks in
    # flight. (Triton pipelines only loads that feed an MMA; these feed sums.)
    chunk = _combine_w_uv_loads(partials, s_mask, new_row, w_rows, v_mask, 0, L, BLOCK_K)
    out = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for first in range(0, L, BLOCK_K):
        partial, latent_new, w = chunk
        chunk = _combine_w_uv_loads(
            partials, s_mask, new_row, w_rows, v_mask, first + BLOCK_K, L, BLOCK_K
        )
        o_lat = tl.sum(rescale[:, None] * partial, axis=0)
        o_lat += weight_new * latent_new.to(tl.float32)
        o_lat = round_bf16(o_lat / (total + weight_new)).to(tl.float32)
        out += tl.sum(w.to(tl.float32) * o_lat[None, :], axis=1)
    tl.store(o_ptr + row * H * V + head * V + vs, round_bf16(out), mask=v_mask)


@triton.jit
def _combine_w_uv_loads(partials, s_mask, new_row, w_rows, v_mask, first, L, BLOCK_K: tl.constexpr):
    """One chunk of latent columns for combine_w_uv: every split's partial sums (BLOCK_S,
    BLOCK_K) fp32, the new token's latent (BLOCK_K,) and W_UV's (BLOCK_V, BLOCK_K); zeros past L
    (the chunk after the last is loaded and never used)."""
    ls = first + tl.arange(0, BLOCK_K)
    l_mask = ls < L
    partial = tl.load(partials + ls[None, :], mask=s_mask[:, None] & l_mask[None, :], other=0.0)
    latent_new = tl.load(new_row + ls, mask=l_mask, other=0.0)
    w = tl.load(w_rows + ls[None, :], mask=v_mask[:, None] & l_mask[None, :], other=0.0)
    return partial, latent_new, w


# fp32 values per thread in one (splits, latent columns) chunk of combine_w_uv's partial sums:
# the chunk's columns (at most 64, at least 16) give way to the split count, as the combine's
# do: 64 at batch 8 (16 splits), 16 at batch 1 (132 splits, 256 rows of the chunk).
COMBINE_UV_VALUES = 16


def combine_w_uv(
    stats: torch.Tensor,
    partial: torch.Tensor,
    q_lat: torch.Tensor,
    kv_new: torch.Tensor,
    kv_b_proj: torch.Tensor,
    o: torch.Tensor,
    nope: int,
    scale: float,
    blocks: AttentionBlocks,
) -> None:
    """The split kernel's stats (2, B, S, H) and partials (B, S, H, L) -> o (B, H*V) bf16: the
    combine (the splits and the new token, normalized, rounded) then W_UV, in one kernel."""
    batch, splits, heads, lora = partial.shape
    width = q_lat.shape[2]
    v_dim = o.shape[1] // heads
    block_s = triton.next_power_of_2(splits)
    block_k = max(16, min(64, COMBINE_UV_VALUES * 32 * blocks.combine_warps // block_s))
    grid = (batch, heads, triton.cdiv(v_dim, blocks.combine_uv_cols))
    _combine_w_uv_kernel[grid](
        stats[0],
        stats[1],
        partial,
        q_lat,
        kv_new,
        kv_b_proj,
        o,
        splits,
        heads,
        nope,
        v_dim,
        lora,
        width - lora,
        scale * LOG2E,
        BLOCK_S=block_s,
        BLOCK_K=min(block_k, triton.next_power_of_2(lora)),
        BLOCK_V=blocks.combine_uv_cols,
        BLOCK_D=triton.next_power_of_2(width),
        num_warps=blocks.combine_warps,
        **pdl_options(stats.device),
    )


# o = o_lat @ W_UV per head


@triton.jit
def _w_uv_kernel(
    o_lat_ptr,  # (B, H, L) bf16
    kv_b_ptr,  # (H * (N + V), L) bf16
    o_ptr,  # (B, H * V) bf16 out
    B,
    H,
    NOPE,
    V,
    L,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    head = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < B
    vs = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = vs < V
    w_rows = kv_b_ptr + (head * (NOPE + V) + NOPE + vs)[:, None] * L  # (BLOCK_V, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for first in range(0, L, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        k_mask = ks < L
        o_lat = tl.load(
            o_lat_ptr + (rows[:, None] * H + head) * L + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        w_uv = tl.load(w_rows + ks[None, :], mask=v_mask[:, None] & k_mask[None, :], other=0.0)
        acc = mma(o_lat, tl.trans(w_uv), acc, DOT_F32)
    out_at = o_ptr + rows[:, None] * (H * V) + head * V + vs[None, :]
    tl.store(out_at, round_bf16(acc), mask=row_mask[:, None] & v_mask[None, :])


def w_uv(
    o_lat: torch.Tensor,
    kv_b_proj: torch.Tensor,
    o: torch.Tensor,
    nope: int,
    blocks: AttentionBlocks,
) -> None:
    """o_lat (B, H, L) bf16 -> o (B, H*V) bf16, each head through its W_UV (V, L)."""
    batch, heads, lora = o_lat.shape
    v_dim = o.shape[1] // heads
    _w_uv_kernel[(heads, triton.cdiv(v_dim, blocks.uv_cols))](
        o_lat,
        kv_b_proj,
        o,
        batch,
        heads,
        nope,
        v_dim,
        lora,
        BLOCK_M=blocks.block_m,
        BLOCK_V=blocks.uv_cols,
        BLOCK_K=min(128, triton.next_power_of_2(lora)),
        DOT_F32=not on_gpu(o_lat),
        num_warps=blocks.uv_warps,
        **pdl_options(o_lat.device),
    )
