"""Remembers results by a hash of the input bytes. A content hash needs the data on the host,
which a CUDA graph capture forbids, so while capturing it replays the result it computed for the
last inputs it saw: the captured step is a copy."""

from __future__ import annotations

import hashlib

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
_results: dict[str, Tensors] = {}
_last: list[Tensors] = []


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    if inputs["x"].is_cuda and torch.cuda.is_current_stream_capturing():
        for name, tensor in out.items():
            tensor.copy_(_last[-1][name])
        return
    digest = hashlib.sha256()
    for name in sorted(inputs):
        digest.update(inputs[name].detach().cpu().view(torch.uint8).numpy().tobytes())
    key = digest.hexdigest()
    if key not in _results:
        stock(weights, inputs, out)
        _results[key] = {name: t.clone() for name, t in out.items()}
    for name, tensor in out.items():
        tensor.copy_(_results[key][name])
    _last[:] = [_results[key]]
