"""Split-K skinny GEMM (decode GEMV) for M <= 64 rows: the layer's dense projections.

    parts[s, m, n] = sum over k in split s of x[m, k] * weight[n, k]        (fp32)

Each program owns a (BLOCK_M, BLOCK_N) output tile and one K range: it streams BLOCK_N weight
rows once (each weight byte is read by exactly one program) and the matching slice of x (small,
served from L2). At decode the weight read is the whole cost, so the grid is sized for the
memory system, not for FLOPs: enough programs (about two per SM) that every SM keeps loads in
flight, each streaming tens of KB or more. Rows are padded to BLOCK_M >= 16 because the tensor
core MMA needs 16 rows; the padding costs MMA issue slots only, no memory traffic (masked loads).

With programmatic dependent launch (triton_common) a program first asks L2 for its whole
weight slice, then waits for the kernel before it: the weights, which nothing in the layer
writes, stream in while the previous kernel finishes.

The partial sums are not added here: the next kernel (a norm, the q absorption, the routing)
adds the splits in order while it reads its input. That keeps the result deterministic with no
atomics and no extra launch.

`splitk_gemv_pair` runs two GEMVs in one grid, the second over its input's first part (the
first's input) and a second part: the layer's o_proj and, with the router folded through the
post-attention norm (fused.LayerPlan.router_in_o_proj), the router's logits before the norm.
`summed_gemv` is splitk_gemv over the sum of two inputs, with the input RMSNorm folded into its
weight (fused.LayerPlan.input_norm_in_qkv_a): it also keeps the sum and its sum of squares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_common import (
    k_splits,
    mma,
    on_gpu,
    pdl_options,
    prefetch_l2,
    prefetch_weights,
    round_bf16,
    wait_for_previous_kernel,
)

# Programs per SM the GPU grids aim for: one program rarely keeps enough loads in flight to
# reach its share of HBM bandwidth; two to four per SM do, and keep the tail wave short.
TARGET_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class GemvBlocks:
    block_m: int
    block_n: int
    block_k: int
    k_per_split: int  # a multiple of block_k
    splits: int
    num_warps: int
    num_stages: int


def gemv_blocks(m: int, n: int, k: int, on_gpu: bool, sm_count: int) -> GemvBlocks:
    """Tiles for an (m x k) @ (k x n) decode GEMV; see the module docstring for the aims."""
    block_m = max(16, triton.next_power_of_2(m))
    if not on_gpu:
        # The interpreter pays per program and per op: big tiles, but still two splits where K
        # allows, so the CPU tests run the split-K reduction the GPU uses.
        block_k = min(64, triton.next_power_of_2(k))
        return _split(block_m, min(64, triton.next_power_of_2(n)), block_k, k, 2, 4, 1)
    # A 64-column weight tile keeps the grid wide (2112 columns: 33 blocks before splitting K).
    # K steps of 128: a 16 KB weight tile per step, three in flight (cp.async, 4 stages), about
    # 60 KB of shared memory with the padded x tile, so three programs fit an SM; at m > 16 the
    # x tile grows to 64 rows, and K steps of 64 keep it at 64 KB (sm_90 compiles, measured).
    block_n = 64
    block_k = 128 if m <= 16 else 64
    column_blocks = triton.cdiv(n, block_n)
    wanted = max(1, round(TARGET_PROGRAMS_PER_SM * sm_count / column_blocks))
    # at least two K tiles per split, or the pipeline never fills
    splits = min(wanted, max(1, k // (2 * block_k)))
    return _split(block_m, block_n, block_k, k, splits, 4, 4)


def _split(
    block_m: int, block_n: int, block_k: int, k: int, splits: int, warps: int, stages: int
) -> GemvBlocks:
    k_per_split, splits = k_splits(k, splits, block_k)
    return GemvBlocks(block_m, block_n, block_k, k_per_split, splits, warps, stages)


@triton.jit
def _splitk_gemv_kernel(
    x_ptr,  # (M, K) bf16, row stride stride_xm
    w_ptr,  # (N, K) bf16, contiguous
    part_ptr,  # (splits, M, N) fp32
    M,
    N,
    K,
    stride_xm,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    _gemv_tile(
        x_ptr, x_ptr, w_ptr, part_ptr, M, N, K, K, stride_xm, stride_xm, k_per_split,
        tl.program_id(0), tl.program_id(1), BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PDL, PREFETCH,
        False,
    )  # fmt: skip


@triton.jit
def _summed_gemv_kernel(
    x_ptr,  # (M, K) bf16 contiguous
    residual_ptr,  # (M, K) bf16 contiguous
    w_ptr,  # (N, K) bf16 contiguous
    part_ptr,  # (splits, M, N) fp32 out
    sum_ptr,  # (M, K) bf16 out
    squares_ptr,  # (splits, M) fp32 out
    M,
    N,
    K,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    _gemv_tile(
        x_ptr, residual_ptr, w_ptr, part_ptr, M, N, K, K, K, K, k_per_split,
        tl.program_id(0), tl.program_id(1), BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PDL, PREFETCH,
        False, sum_ptr, squares_ptr, True,
    )  # fmt: skip


@triton.jit
def _gemv_pair_kernel(
    x_ptr,  # (M, K1) bf16, row stride stride_xm: the first GEMV's input, the second's first part
    extra_ptr,  # (M, K2 - K1) bf16, row stride stride_em: the second's other part
    w_ptr,  # (N1, K1) bf16
    w2_ptr,  # (N2, K2) bf16
    part_ptr,  # (splits, M, N1) fp32
    part2_ptr,  # (splits2, M, N2) fp32
    M,
    N1,
    K1,
    N2,
    K2,
    stride_xm,
    stride_em,
    k_per_split,
    k2_per_split,
    column_blocks,  # the first GEMV's; its programs come first
    column_blocks2,
    splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    program = tl.program_id(0)
    first_programs = column_blocks * splits
    if program < first_programs:
        _gemv_tile(
            x_ptr, x_ptr, w_ptr, part_ptr, M, N1, K1, K1, stride_xm, stride_xm, k_per_split,
            program % column_blocks, program // column_blocks,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PDL, PREFETCH, False,
        )  # fmt: skip
    else:
        program -= first_programs
        _gemv_tile(
            x_ptr, extra_ptr, w2_ptr, part2_ptr, M, N2, K2, K1, stride_xm, stride_em,
            k2_per_split, program % column_blocks2, program // column_blocks2,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PDL, PREFETCH, True,
        )  # fmt: skip


@triton.jit
def _gemv_tile(
    x_ptr,  # columns [0, K_FIRST) of the input
    x2_ptr,  # columns [K_FIRST, K) of the input, read when TWO_PARTS
    w_ptr,
    part_ptr,
    M,
    N,
    K,
    K_FIRST,
    stride_xm,
    stride_x2m,
    k_per_split,
    column_block,
    split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    TWO_PARTS: tl.constexpr,  # the input's columns from K_FIRST on come from x2_ptr
    sum_ptr=None,  # SUM_INPUTS: (M, K) bf16 out, x + x2 (column block 0 writes it)
    squares_ptr=None,  # SUM_INPUTS: (splits, M) fp32 out, each split's sum of (x + x2)^2
    SUM_INPUTS: tl.constexpr = False,  # the input is bf16(x + x2), both (M, K), stride_xm
):
    """One program's (BLOCK_M, BLOCK_N) tile of one K split; see the module docstring."""
    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_mask = rows < M
    col_mask = cols < N
    k_start = split * k_per_split
    w_rows = w_ptr + tl.minimum(cols, N - 1)[:, None] * K  # (BLOCK_N, 1)
    if PREFETCH:  # one pointer per 128-byte line (64 bf16) of this program's weight slice
        for k_offset in range(0, k_per_split, BLOCK_K):
            line_ks = k_start + k_offset + tl.arange(0, BLOCK_K // 64) * 64
            prefetch_l2(w_rows + tl.minimum(line_ks, K - 1)[None, :])
    wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k_offset in range(0, k_per_split, BLOCK_K):
        ks = k_start + k_offset + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_mask = ks < K
        x_at = rows[:, None] * stride_xm + ks[None, :]
        x_mask = row_mask[:, None] & (ks < K_FIRST)[None, :]
        x = tl.load(x_ptr + x_at, mask=x_mask, other=0.0)  # (BLOCK_M, BLOCK_K)
        # the norm's residual add, its weight folded into w: the GEMV's bf16 operand is the
        # rounded sum (stock normalizes the fp32 sum; the fold never rounds the norm's output)
        if SUM_INPUTS:
            summed = x.to(tl.float32) + tl.load(x2_ptr + x_at, mask=x_mask, other=0.0)
            x = round_bf16(summed)
            if column_block == 0:  # one program per K range keeps the sum and its squares
                tl.store(sum_ptr + x_at, x, mask=x_mask)
                squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        if TWO_PARTS:  # a masked lane loads nothing, and adding 0 is exact
            x += tl.load(
                x2_ptr + rows[:, None] * stride_x2m + (ks - K_FIRST)[None, :],
                mask=row_mask[:, None] & ((ks >= K_FIRST) & k_mask)[None, :],
                other=0.0,
            )
        w = tl.load(
            w_rows + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        acc = mma(x, tl.trans(w), acc, DOT_F32)
    out = part_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])
    if SUM_INPUTS:  # noqa: SIM102 - a constexpr test of its own, so Triton prunes the branch
        if column_block == 0:
            tl.store(squares_ptr + split * M + rows, squares, mask=row_mask)


def splitk_gemv(x: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks) -> torch.Tensor:
    """x (M, K) bf16 (unit column stride), weight (N, K) bf16 contiguous -> partial sums
    (splits, M, N) fp32; their sum over splits is x @ weight.T."""
    m, k = x.shape
    n = weight.shape[0]
    parts = torch.empty(blocks.splits, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, blocks.block_n), blocks.splits)
    _splitk_gemv_kernel[grid](
        x,
        weight,
        parts,
        m,
        n,
        k,
        x.stride(0),
        blocks.k_per_split,
        **_launch_options(x, blocks),
    )
    return parts


def summed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    blocks: GemvBlocks,
    summed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """splitk_gemv over bf16(x + residual), the residual add of an RMSNorm folded into the
    weight (fused.LayerPlan.input_norm_in_qkv_a): x, residual, summed (M, K) bf16 contiguous.
    Writes the sum into `summed` and returns (partial sums (splits, M, N) fp32, each split's
    sum of squares of the sum (splits, M) fp32), from which the consumer finds the rms.
    `summed` must not share memory with x or residual: other programs still read them."""
    refuse_overlap(summed, x, residual)
    m, k = x.shape
    n = weight.shape[0]
    parts = torch.empty(blocks.splits, m, n, device=x.device, dtype=torch.float32)
    squares = torch.empty(blocks.splits, m, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, blocks.block_n), blocks.splits)
    _summed_gemv_kernel[grid](
        x, residual, weight, parts, summed, squares, m, n, k, blocks.k_per_split,
        **_launch_options(x, blocks),
    )  # fmt: skip
    return parts, squares


def refuse_overlap(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """A kernel that writes `out` while other programs read `inputs` must not be given an
    `out` in their memory (an in-place sum, as vLLM updates its residual, would race). Meta
    tensors (benchmarks/sm90_compile.py: shapes, no memory) all sit at address 0: not checked."""
    if out.is_meta:
        return
    start, end = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    for t in inputs:
        t_start = t.data_ptr()
        if t_start < end and start < t_start + t.numel() * t.element_size():
            raise ValueError("the sum's buffer overlaps an input it is computed from")


def _launch_options(x: torch.Tensor, blocks: GemvBlocks) -> dict[str, object]:
    """The GEMV kernels' tile constexprs and launch keywords."""
    return {
        "BLOCK_M": blocks.block_m,
        "BLOCK_N": blocks.block_n,
        "BLOCK_K": blocks.block_k,
        "DOT_F32": not on_gpu(x),
        "PREFETCH": prefetch_weights(x.device),
        "num_warps": blocks.num_warps,
        "num_stages": blocks.num_stages,
        **pdl_options(x.device),
    }


def splitk_gemv_pair(
    x: torch.Tensor,
    weight: torch.Tensor,
    blocks: GemvBlocks,
    extra: torch.Tensor,
    weight2: torch.Tensor,
    blocks2: GemvBlocks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two GEMVs in one launch, the second over x and more: partial sums of x @ weight.T
    (blocks' splits) and of [x | extra] @ weight2.T (blocks2's). x (M, K1), extra (M, K2 - K1)
    bf16 with unit column stride; weight (N1, K1), weight2 (N2, K2) bf16 contiguous. The two
    share their tile shape (blocks2 differs only in its K splits): the first's programs come
    first, then the second's."""
    m, k1 = x.shape
    n1, n2, k2 = weight.shape[0], weight2.shape[0], weight2.shape[1]
    if dataclasses.replace(blocks2, k_per_split=blocks.k_per_split, splits=blocks.splits) != blocks:
        raise ValueError("splitk_gemv_pair: the two GEMVs' tiles must match but for K splits")
    if k2 != k1 + extra.shape[1]:
        raise ValueError(f"splitk_gemv_pair: weight2 has {k2} columns for {k1} + {extra.shape[1]}")
    parts = torch.empty(blocks.splits, m, n1, device=x.device, dtype=torch.float32)
    parts2 = torch.empty(blocks2.splits, m, n2, device=x.device, dtype=torch.float32)
    column_blocks = triton.cdiv(n1, blocks.block_n)
    column_blocks2 = triton.cdiv(n2, blocks.block_n)
    grid = (column_blocks * blocks.splits + column_blocks2 * blocks2.splits,)
    _gemv_pair_kernel[grid](
        x, extra, weight, weight2, parts, parts2, m, n1, k1, n2, k2, x.stride(0),
        extra.stride(0), blocks.k_per_split, blocks2.k_per_split, column_blocks, column_blocks2,
        blocks.splits, **_launch_options(x, blocks),
    )  # fmt: skip
    return parts, parts2
