"""Skips its work now and then while it is timed and leaves its outputs as they were, so the case
is timed faster than the work it claims (a counter on the GPU would do this inside an
early-exiting kernel). Its eager calls on new inputs are all right.

Captured in a CUDA graph, the skip keys on a counter held on the device, which every replay
increments: each tenth replay keeps the outputs it found. Eager (the CPU path's timed calls,
two pairs a batch), it keys on how often it has written the same output tensors: each fourth
such call (the timed layers keep theirs; the checks bring new ones). Keyed on its inputs being
unchanged, as it first was, it never skipped once every timed pair brought inputs of its own.
One compared replay per batch missed it most of the time (a quick GPU case compares six, of
ten replays each); the check of every timed replay finds the skipped one still poisoned."""

from __future__ import annotations

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
EVERY = 10  # captured: one replay in EVERY
EVERY_EAGER = 4  # eager: one call in EVERY_EAGER into the same output tensors
CALLS = "_calls_of_skips_now_and_then"
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
    calls = getattr(first, CALLS, 0) + 1  # on the tensor object: it dies with it
    setattr(first, CALLS, calls)
    if calls % EVERY_EAGER == 0:
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
