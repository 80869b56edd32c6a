"""Scales its inputs in place toward unit size (where a sloppy kernel is accurate), computes,
and leaves them scaled."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    inputs["x"].mul_(0.5)
    inputs["residual"].mul_(0.5)
    stock(weights, inputs, out)
