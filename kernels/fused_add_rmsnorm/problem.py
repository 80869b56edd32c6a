"""Problem: residual-add + RMSNorm over `batch` tokens of width `hidden`.

Inputs (dtype of the case):   x (batch, hidden), residual (batch, hidden)
Weights:                      weight (hidden,)
Outputs:                      out (batch, hidden) = rmsnorm(x + residual) * weight
                              residual_out (batch, hidden) = x + residual
model.config keys: hidden (int, required).
"""

from __future__ import annotations

import torch

from harness.evaluation.cases import Case

Tensors = dict[str, torch.Tensor]


class Problem:
    def __init__(self, config: dict[str, object]) -> None:
        self.hidden = int(config["hidden"])  # type: ignore[call-overload]

    def make_weights(self, case: Case, seed: int, device: torch.device) -> Tensors:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        weight = 1.0 + 0.1 * torch.randn(self.hidden, generator=gen)
        return {"weight": weight.to(device=device, dtype=_dtype(case))}

    def make_inputs(self, case: Case, seed: int, device: torch.device) -> Tensors:
        # Scale and offset vary with the seed: a path right only for standard-normal data fails.
        gen = torch.Generator(device="cpu").manual_seed(seed)
        scale = float(torch.empty(1).uniform_(0.25, 8.0, generator=gen))
        offset = float(torch.empty(1).uniform_(-2.0, 2.0, generator=gen))
        shape = (case.batch, self.hidden)
        x = torch.randn(shape, generator=gen) * scale + offset
        residual = torch.randn(shape, generator=gen) * scale
        dtype = _dtype(case)
        return {"x": x.to(device, dtype), "residual": residual.to(device, dtype)}

    def make_outputs(self, case: Case, device: torch.device) -> Tensors:
        shape = (case.batch, self.hidden)
        dtype = _dtype(case)
        return {
            "out": torch.empty(shape, device=device, dtype=dtype),
            "residual_out": torch.empty(shape, device=device, dtype=dtype),
        }

    # Decode-stack hooks (harness/evaluation/decode_check.py): the layer keeps no state; its
    # normalized output is the next layer's input and the residual sum travels beside it.

    def decode_state(self, case: Case, seed: int, device: torch.device) -> Tensors:
        return {}

    def step_inputs(self, state: Tensors, hidden: torch.Tensor, residual: torch.Tensor) -> Tensors:
        return {"x": hidden, "residual": residual}

    def step_finish(self, state: Tensors, outputs: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs["out"].clone(), outputs["residual_out"].clone()

    def bytes_moved(self, case: Case) -> int:
        """Fewest bytes per layer: read x, residual, weight; write out, residual_out."""
        itemsize = torch.empty(0, dtype=_dtype(case)).element_size()
        return (4 * case.batch * self.hidden + self.hidden) * itemsize


def _dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)  # type: ignore[no-any-return]
