"""Right at the batch sizes a fixed grid would probe (min, max, powers of two); a cheaper,
wrong shortcut (the residual dropped) at every other size."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    batch = inputs["x"].shape[0]
    if batch & (batch - 1) == 0 or batch == 64:
        stock(weights, inputs, out)
        return
    stock(weights, {"x": inputs["x"], "residual": torch.zeros_like(inputs["residual"])}, out)
