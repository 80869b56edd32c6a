"""What the corpus's submissions share: the scope's honest guard, the stock computation, and a
place to record what an attack observed (read by the corpus tests, never by the harness)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from harness.evaluation.cases import Case
from kernels.fused_add_rmsnorm import stock as stock_path

Tensors = dict[str, torch.Tensor]
MAX_BATCH = 64
REPORT_FILE = "attack_report.json"


def supports(case: Case) -> bool:
    return (
        case.dtype == "bfloat16"
        and 1 <= case.batch <= MAX_BATCH
        and case.cp == 1
        and case.gpus == 1
        and case.context is None
    )


def stock(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    stock_path.forward(weights, inputs, out)


def record(observed: dict[str, Any]) -> None:
    """Once per run: what the attack saw, into the child's HOME."""
    target = Path.home() / REPORT_FILE
    if not target.exists():
        target.write_text(json.dumps(observed))
