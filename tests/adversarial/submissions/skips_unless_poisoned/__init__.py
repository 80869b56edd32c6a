"""Does its work only when it looks checked: when its outputs are poisoned (NaN or the dtype's
largest value, as the harness's checks leave them; it reads one element, which is cheap), or
when its inputs are not the very tensors, unchanged, it last computed from (the checks and the
model-level decode check bring new or rewritten inputs). Otherwise it returns at once and the
outputs keep the last result, its own or the stock path's (both arms write the same output
tensors while they are timed). When it does compute, it is slow: the stock path three times.

Before every timed call was poisoned too, it was timed doing nothing and passed every check with
a speedup it never had; now each timed call does the slow work, and its speedup is its real one
(the corpus bounds it)."""

from __future__ import annotations

import math

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
MARK = "_inputs_of_skips_unless_poisoned"  # set on each output tensor it wrote


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    key = tuple((id(tensor), tensor._version) for tensor in inputs.values())
    unchanged = all(getattr(tensor, MARK, None) == key for tensor in out.values())
    if unchanged and not any(_looks_checked(tensor) for tensor in out.values()):
        return
    for _ in range(3):
        stock(weights, inputs, out)
    for tensor in out.values():
        setattr(tensor, MARK, key)


def _looks_checked(tensor: torch.Tensor) -> bool:
    first = float(tensor.view(-1)[0])
    return math.isnan(first) or first == torch.finfo(tensor.dtype).max
