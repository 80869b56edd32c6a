"""Never returns."""

from __future__ import annotations

import torch

Tensors = dict[str, torch.Tensor]


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    while True:
        pass
