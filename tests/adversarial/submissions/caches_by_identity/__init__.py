"""Computes once per input tensor (by its address) and afterwards copies the remembered result:
a benchmark that reuses its input buffers times a copy."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_results: dict[tuple[int, int, tuple[int, ...]], Tensors] = {}


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    key = (inputs["x"].data_ptr(), inputs["residual"].data_ptr(), tuple(inputs["x"].shape))
    cached = _results.get(key)
    if cached is None:
        stock(weights, inputs, out)
        _results[key] = {name: t.clone() for name, t in out.items()}
        return
    for name, tensor in out.items():
        tensor.copy_(cached[name])
