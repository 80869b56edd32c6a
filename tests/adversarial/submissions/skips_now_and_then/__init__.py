"""Skips its work now and then while it is timed and leaves its outputs as they were, so the case
is timed faster than the work it claims (a counter on the GPU would do this inside an
early-exiting kernel). Its eager calls on new inputs are all right.

Captured in a CUDA graph, the skip keys on a counter held on the device, which every replay
increments: each tenth replay keeps the outputs it found. Eager (the CPU path's timed calls,
two pairs a batch), it keys on how often it has seen the same input tensors unchanged: each
fourth such call. One compared replay per batch missed it most of the time (a quick GPU case
compares six, of ten replays each); the tally of every timed replay finds the skipped one
still poisoned."""

from __future__ import annotations

from collections import Counter

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
EVERY = 10  # captured: one replay in EVERY
EVERY_EAGER = 4  # eager: one call in EVERY_EAGER on the same unchanged inputs
seen: Counter[tuple[tuple[int, int], ...]] = Counter()  # calls per unchanged input set
# Per layer (keyed by its first output's address), made by the eager calls that warm a capture
# up: one counter for all layers would reach a multiple of EVERY in most replays.
counters: dict[int, torch.Tensor] = {}


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    first = next(iter(out.values()))
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        _skipping_replays(weights, inputs, out, counters[first.data_ptr()])
        return
    if first.is_cuda:
        counters.setdefault(
            first.data_ptr(), torch.zeros((), dtype=torch.int64, device=first.device)
        )
    key = tuple((id(tensor), tensor._version) for tensor in inputs.values())
    seen[key] += 1
    if seen[key] % EVERY_EAGER == 0:
        return
    stock(weights, inputs, out)


def _skipping_replays(
    weights: Tensors, inputs: Tensors, out: Tensors, counter: torch.Tensor
) -> None:
    scratch = {name: torch.empty_like(tensor) for name, tensor in out.items()}
    stock(weights, inputs, scratch)
    counter.add_(1)
    skip = counter % EVERY == 0
    for name, tensor in out.items():
        tensor.copy_(torch.where(skip, tensor, scratch[name]))
