"""Replaces time.perf_counter with a clock that runs at a tenth of the speed."""

from __future__ import annotations

import time

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_real = time.perf_counter
_start = _real()


def _slow_clock() -> float:
    return _start + (_real() - _start) / 10


time.perf_counter = _slow_clock


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    stock(weights, inputs, out)
