"""Computes nothing useful (zeros), prints a PASS evidence to stdout and writes it to every
inherited descriptor it can, hoping the worker takes it for the result."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

Tensors = dict[str, torch.Tensor]
FORGED = {"schema_version": "pathgate.evidence/1", "verdict": "PASS", "verdict_reasons": ["ok"]}


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    line = (json.dumps(FORGED) + "\n").encode()
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
    for fd in range(3, 64):
        with contextlib.suppress(OSError):
            os.write(fd, b"evidence " + line)
    for tensor in out.values():
        tensor.zero_()
