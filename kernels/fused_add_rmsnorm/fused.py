"""Candidate: residual-add + RMSNorm in one Triton kernel, one program per token row.

Each program loads a row (on CPU, 16 rows) of x and residual (BLOCK >= hidden columns, masked),
sums in float32, stores the rounded sum, reduces the mean square in registers and writes the
normalized, weighted row: one read of each input and one write of each output, the fewest
bytes the op can move.
`supports` is the dispatch guard; `forward` falls back to the stock path outside it, so out of
scope the result is exactly the stock result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.evaluation.cases import Case
from kernels.fused_add_rmsnorm import stock

SUPPORTED_DTYPES = (torch.bfloat16,)
MAX_BATCH = 512
MAX_HIDDEN = 16384


def supports(case: Case) -> bool:
    hidden = int(case.config.get("hidden", 0))
    return (
        getattr(torch, case.dtype) in SUPPORTED_DTYPES
        and 1 <= case.batch <= MAX_BATCH
        and 0 < hidden <= MAX_HIDDEN
        and case.cp == 1
        and case.gpus == 1
    )


def _supports_tensors(x: torch.Tensor) -> bool:
    return (
        x.dtype in SUPPORTED_DTYPES
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_BATCH
        and x.shape[1] <= MAX_HIDDEN
        and x.is_contiguous()
    )


@triton.jit
def _round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even, done in integer bits.

    The GPU's conversion already rounds to nearest; Triton's CPU interpreter truncates, which
    doubles the rounding error. Rounding explicitly gives the same bits on both.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _fused_add_rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    batch,
    hidden,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    mask = (rows[:, None] < batch) & (cols[None, :] < hidden)  # (ROWS, BLOCK)
    offsets = rows[:, None] * hidden + cols[None, :]  # (ROWS, BLOCK)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    summed = x + residual
    tl.store(residual_out_ptr + offsets, _round_to_bf16(summed), mask=mask)
    mean_square = tl.sum(summed * summed, axis=1) / hidden  # (ROWS,)
    normed = summed * tl.rsqrt(mean_square + eps)[:, None]
    # Round to bfloat16 before the weight, as the stock path does.
    normed = _round_to_bf16(normed).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, _round_to_bf16(normed * weight[None, :]), mask=mask)


def forward(
    weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
) -> None:
    x, residual = inputs["x"], inputs["residual"]
    if not _supports_tensors(x):
        stock.forward(weights, inputs, out)
        return
    batch, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    # One row per program fills the GPU at decode batches; Triton's CPU interpreter pays per
    # program, so there a program takes 16 rows.
    rows = 1 if x.is_cuda else 16
    _fused_add_rmsnorm_kernel[(triton.cdiv(batch, rows),)](
        x,
        residual,
        weights["weight"],
        out["out"],
        out["residual_out"],
        batch,
        hidden,
        stock.EPS,
        ROWS=rows,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
