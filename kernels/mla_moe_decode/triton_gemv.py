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
    prefetch_l2,
    prefetch_weights,
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
    column_block = tl.program_id(0)
    split = tl.program_id(1)
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
    for k_offset in range(0, k_per_split, BLOCK_K):
        ks = k_start + k_offset + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        w = tl.load(
            w_rows + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        acc = mma(x, tl.trans(w), acc, DOT_F32)
    out = part_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & col_mask[None, :])


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
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        DOT_F32=not on_gpu(x),
        PREFETCH=prefetch_weights(x.device),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
        **pdl_options(x.device),
    )
    return parts
