"""Slows the path it is measured against: both paths are timed on the same weight tensors, so
on its first timed call (outputs not poisoned, which the correctness checks always are) it
keeps a private copy of the norm's weight, computes from that copy from then on, and fills the
shared one with subnormal values for the stock path to read (bf16 multiplies on subnormals are
many times slower on a CPU; on a GPU the same lever is a MoE router's bias, which decides how
many experts the stock path reads). Its own outputs stay right everywhere."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
SUBNORMAL = 1e-39
_private: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (shared, private copy)


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    shared = weights["weight"]
    kept = _private.get(id(shared))
    if kept is not None and kept[0] is shared:
        own = kept[1]
    elif _poisoned(out["out"]):
        own = shared
    else:
        own = shared.clone()
        _private[id(shared)] = (shared, own)
        shared.fill_(SUBNORMAL)
    stock({**weights, "weight": own}, inputs, out)


def _poisoned(tensor: torch.Tensor) -> bool:
    return bool(tensor.isnan().all() or (tensor == torch.finfo(tensor.dtype).max).all())
