"""Residual add + RMSNorm whose first operand arrives as split-K partial sums.

    a            = sum over splits of parts[s, b, :]           (the projection, fp32)
    sum          = a + residuals[0][b] (+ residuals[1][b])     (fp32)
    residual_out = bf16(sum)
    out          = bf16(sum * rsqrt(mean(sum^2) + eps) * weight)

The layer's post-attention norm reads o_proj's partial sums this way (no separate reduction
kernel), and the layer's two inputs x and residual rather than the input norm's bf16 sum of them:
every intermediate stays fp32 (ROUNDING in triton_common.py). With one "split" holding bf16 x
it is the input_layernorm: the CPU stand-in for the CuTe DSL kernel of cute_kernels.py, which
the GPU runs instead.
One program per token row on the GPU; the row (7168 wide on the real shard) sits in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_common import (
    on_gpu,
    pdl_options,
    rms_normalize,
    round_bf16,
    rows_per_program,
    sum_splits,
    wait_for_previous_kernel,
)


@triton.jit
def _add_rmsnorm_kernel(
    part_ptr,  # (splits, B, D) fp32 partial sums, or (1, B, D) bf16
    residual_ptr,  # (B, D) bf16
    residual2_ptr,  # (B, D) bf16, read when TWO_RESIDUALS
    weight_ptr,  # (D,) bf16
    residual_out_ptr,  # (B, D) bf16
    out_ptr,  # (B, D) bf16
    N_SPLITS: tl.constexpr,  # sum_splits unrolls over it
    split_stride,
    B,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TWO_RESIDUALS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < B)[:, None] & (cols < D)[None, :]  # (ROWS, BLOCK_D)
    offsets = rows[:, None] * D + cols[None, :]
    projected = sum_splits(part_ptr, offsets, mask, N_SPLITS, split_stride)
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if TWO_RESIDUALS:
        residual += tl.load(residual2_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    summed = projected + residual
    tl.store(residual_out_ptr + offsets, round_bf16(summed), mask=mask)
    weight = tl.load(weight_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, rms_normalize(summed, D, eps, weight[None, :]), mask=mask)


def add_rmsnorm(
    parts: torch.Tensor,
    residuals: tuple[torch.Tensor, ...],
    weight: torch.Tensor,
    residual_out: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
) -> None:
    """parts (splits, B, D) fp32 or (1, B, D) bf16; one or two residuals (B, D) bf16 -> writes
    residual_out and out (B, D) bf16 as the module docstring says. num_warps: by default one
    per 512 columns, at most 16."""
    if len(residuals) not in (1, 2):
        raise ValueError(f"one or two residuals, not {len(residuals)}")
    n_splits, batch, hidden = parts.shape
    block = triton.next_power_of_2(hidden)
    rows = rows_per_program(batch, on_gpu(parts))
    _add_rmsnorm_kernel[(triton.cdiv(batch, rows),)](
        parts,
        residuals[0],
        residuals[-1],
        weight,
        residual_out,
        out,
        n_splits,
        batch * hidden,
        batch,
        hidden,
        eps,
        ROWS=rows,
        BLOCK_D=block,
        TWO_RESIDUALS=len(residuals) == 2,
        num_warps=num_warps or min(16, max(1, block // 512)),
        **pdl_options(parts.device),
    )
