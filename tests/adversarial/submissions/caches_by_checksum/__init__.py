"""Keeps its last result for each output tensor and copies it back while a checksum of its
inputs (a few elements of each: cheap) matches the one it computed from; computes otherwise,
slowly (the stock path three times). On a GPU the same needs a kernel that checks the sum and
exits early inside the captured graph; here the host does it.

While the timed pairs all ran on one input set, every timed call after the first was served
from the copy: right outputs, timed doing a copy, and no check could tell. Now every pair runs
on inputs of its own, so each timed call computes and its speedup is its real one (the corpus
bounds it)."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_kept: dict[int, tuple[tuple[float, ...], Tensors]] = {}  # by the output tensor's id


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    checksum = tuple(float(inputs[name].reshape(-1)[:8].float().sum()) for name in sorted(inputs))
    where = id(out["out"])
    if where in _kept and _kept[where][0] == checksum:
        for name, tensor in out.items():
            tensor.copy_(_kept[where][1][name])
        return
    for _ in range(3):
        stock(weights, inputs, out)
    _kept[where] = (checksum, {name: tensor.clone() for name, tensor in out.items()})
