"""Stock path: the torch op sequence of vLLM's native fused_add_rms_norm.

It computes in float32 (or in the inputs' precision when that is higher, which is how the
harness's float64 reference runs the same code), rounds the residual sum to the input dtype, and
multiplies by the weight after rounding the normalized value back, as vLLM's native path does.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def forward(
    weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
) -> None:
    x, residual = inputs["x"], inputs["residual"]
    orig_dtype = x.dtype
    compute = torch.promote_types(orig_dtype, torch.float32)
    summed = x.to(compute) + residual.to(compute)
    out["residual_out"].copy_(summed.to(orig_dtype))
    variance = summed.pow(2).mean(dim=-1, keepdim=True)
    normed = summed * torch.rsqrt(variance + EPS)
    out["out"].copy_(normed.to(orig_dtype) * weights["weight"])
