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

`add_rmsnorm_route` also routes each row (fused.LayerPlan.router_in_o_proj). The norm scales a
row by one number, so the router logits gate @ (sum * weight / rms) are (gate * weight) @ sum,
divided by the rms: o_proj's launch computes the first from o and the layer's residual sum
(triton_gemv.splitk_gemv_pair), and this kernel, which finds the rms anyway, divides and then
picks the experts as triton_moe.route does. The router's GEMV and the routing kernel leave the
layer's chain of kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla_moe_decode.triton_common import (
    inverse_rms,
    on_gpu,
    pdl_options,
    round_bf16,
    rows_per_program,
    sum_splits,
    wait_for_previous_kernel,
)
from kernels.mla_moe_decode.triton_moe import route_method_number, route_rows, route_scratch


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
    _add_rmsnorm_rows(
        part_ptr, residual_ptr, residual2_ptr, weight_ptr, residual_out_ptr, out_ptr, N_SPLITS,
        split_stride, B, D, eps, rows, BLOCK_D, TWO_RESIDUALS,
    )  # fmt: skip


@triton.jit
def _add_rmsnorm_route_kernel(
    part_ptr,  # as _add_rmsnorm_kernel's, to eps
    residual_ptr,
    residual2_ptr,
    weight_ptr,
    residual_out_ptr,
    out_ptr,
    N_SPLITS: tl.constexpr,
    split_stride,
    B,
    D,
    eps,
    router_ptr,  # (R_SPLITS, B, E_TOTAL) fp32: partial sums of the logits before the norm
    R_SPLITS: tl.constexpr,
    router_split_stride,
    bias_ptr,  # as triton_moe.route_rows', to METHOD
    ids_ptr,
    route_weights_ptr,
    scratch_ptr,
    E_TOTAL,
    scaling,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO_RESIDUALS: tl.constexpr,
    METHOD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    row_mask = rows < B
    inverse = _add_rmsnorm_rows(
        part_ptr, residual_ptr, residual2_ptr, weight_ptr, residual_out_ptr, out_ptr, N_SPLITS,
        split_stride, B, D, eps, rows, BLOCK_D, TWO_RESIDUALS,
    )  # fmt: skip
    experts = tl.arange(0, BLOCK_E)
    logit_at = rows[:, None] * E_TOTAL + experts[None, :]  # (ROWS, BLOCK_E)
    logit_mask = row_mask[:, None] & (experts < E_TOTAL)[None, :]
    before_norm = sum_splits(router_ptr, logit_at, logit_mask, R_SPLITS, router_split_stride)
    route_rows(
        before_norm * inverse, rows, row_mask, bias_ptr, ids_ptr, route_weights_ptr, scratch_ptr,
        E_TOTAL, scaling, TOP_K, NORMALIZE, ROWS, BLOCK_E, BLOCK_K, METHOD,
    )  # fmt: skip


@triton.jit
def _add_rmsnorm_rows(
    part_ptr,
    residual_ptr,
    residual2_ptr,
    weight_ptr,
    residual_out_ptr,
    out_ptr,
    N_SPLITS: tl.constexpr,
    split_stride,
    B,
    D,
    eps,
    rows,  # (ROWS,)
    BLOCK_D: tl.constexpr,
    TWO_RESIDUALS: tl.constexpr,
):
    """Stores these rows' residual_out and out (the module docstring); returns their
    1 / rms of the sum, (ROWS, 1) fp32."""
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
    inverse = inverse_rms(summed, D, eps)
    tl.store(out_ptr + offsets, round_bf16(summed * inverse * weight[None, :]), mask=mask)
    return inverse


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


def add_rmsnorm_route(
    parts: torch.Tensor,
    residuals: tuple[torch.Tensor, torch.Tensor],
    weight: torch.Tensor,
    residual_out: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    router_parts: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    normalize: bool,
    scaling: float,
    num_warps: int | None = None,
    method: str = "argmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm with x and residual, and then the routing of each row (triton_moe.route, by
    triton_moe.ROUTE_METHODS[method]) from router_parts (splits, B, E_total) fp32: partial sums
    of the router logits before the norm, (gate * weight) @ the sum, which the row's 1 / rms
    turns into the logits. Returns (ids (B, top_k) int32 global, weights (B, top_k) fp32)."""
    n_splits, batch, hidden = parts.shape
    router_splits, experts_total = router_parts.shape[0], bias.shape[0]
    if router_parts.shape[1:] != (batch, experts_total):
        raise ValueError(f"add_rmsnorm_route: router sums {tuple(router_parts.shape)}")
    ids = torch.empty(batch, top_k, device=parts.device, dtype=torch.int32)
    route_weights = torch.empty(batch, top_k, device=parts.device, dtype=torch.float32)
    block = triton.next_power_of_2(hidden)
    rows = rows_per_program(batch, on_gpu(parts))
    _add_rmsnorm_route_kernel[(triton.cdiv(batch, rows),)](
        parts, residuals[0], residuals[1], weight, residual_out, out, n_splits,
        batch * hidden, batch, hidden, eps,
        router_parts, router_splits, router_parts.stride(0), bias, ids, route_weights,
        route_scratch(parts, experts_total, method), experts_total, scaling,
        TOP_K=top_k,
        NORMALIZE=normalize,
        ROWS=rows,
        BLOCK_D=block,
        BLOCK_E=triton.next_power_of_2(experts_total),
        BLOCK_K=triton.next_power_of_2(top_k),
        TWO_RESIDUALS=True,
        METHOD=route_method_number(method),
        num_warps=num_warps or min(16, max(1, block // 512)),
        **pdl_options(parts.device),
    )  # fmt: skip
    return ids, route_weights
