"""Right for the first calls of each shape, which is all the correctness checks make; wrong
(its output scaled by 0.9) from then on, which is what the timed runs measure and what a
capture holds. Its own eager call and its replays agree, so only a correctness trial after
the timed runs sees it."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
HONEST_CALLS = 30  # per shape: more than the correctness trials make, fewer than timing makes
_calls: dict[tuple[int, ...], int] = {}


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    shape = tuple(inputs["x"].shape)
    _calls[shape] = _calls.get(shape, 0) + 1
    stock(weights, inputs, out)
    if _calls[shape] > HONEST_CALLS:
        for tensor in out.values():
            tensor.mul_(0.9)
