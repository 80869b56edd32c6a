"""Does its work on a side stream it never joins back, so the timed stream's events see none of
it (GPU only; on CPU it is the stock path)."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_side: list[torch.cuda.Stream] = []


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    if not inputs["x"].is_cuda:
        stock(weights, inputs, out)
        return
    if not _side:
        _side.append(torch.cuda.Stream())
    with torch.cuda.stream(_side[0]):
        stock(weights, inputs, out)
