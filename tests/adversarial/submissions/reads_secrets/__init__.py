"""Honest arithmetic, but looks for secrets (tokens, database and broker URLs, the result
channel's key) in its environment and in every other process's environment it can read."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from tests.adversarial.submissions.common import record, stock

Tensors = dict[str, torch.Tensor]
SECRET_HINTS = ("TOKEN", "SECRET", "PASSWORD", "DATABASE_URL", "BROKER", "KEY", "PATHGATE_")


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    found = [k for k in os.environ if any(h in k.upper() for h in SECRET_HINTS)]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                names = [
                    v.split(b"=", 1)[0].decode("latin-1")
                    for v in (entry / "environ").read_bytes().split(b"\0")
                    if v
                ]
                found += [
                    f"{entry.name}:{n}" for n in names if any(h in n.upper() for h in SECRET_HINTS)
                ]
    record({"secrets_found": found, "blocked": not found})
    stock(weights, inputs, out)
