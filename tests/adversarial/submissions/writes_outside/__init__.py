"""Honest arithmetic, but tries to leave files where they would outlive the run: beside its own
workspace (where the next job's checkout goes: a planted git hook ran there once) and in the
harness's own source tree (a backdoor for every later submission)."""

from __future__ import annotations

from pathlib import Path

import torch

import harness
from tests.adversarial.submissions.common import record, stock

Tensors = dict[str, torch.Tensor]
PLANTED = "adversarial-planted.txt"


def targets() -> list[Path]:
    home = Path.home()
    return [home.parent / f"{home.name}-{PLANTED}", Path(harness.__file__).parent / PLANTED]


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    written = []
    for path in targets():
        try:
            path.write_text("planted by a submission\n")
            written.append(str(path))
        except OSError:
            pass
    record({"written": written, "blocked": not written})
    stock(weights, inputs, out)
