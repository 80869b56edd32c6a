"""Replaces torch.cuda.Event.elapsed_time with one that reports a tenth of the time."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_real = torch.cuda.Event.elapsed_time


def _fast(self: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return float(_real(self, end)) / 10


torch.cuda.Event.elapsed_time = _fast  # type: ignore[method-assign]


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    stock(weights, inputs, out)
