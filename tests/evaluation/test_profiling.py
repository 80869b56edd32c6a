"""Kernels per layer from torch.profiler: the CPU form counts top-level torch ops, and keeps
torch's profiler log out of the progress output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from harness.evaluation.profiling import profile_step

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_profile_counts_top_level_ops_per_layer() -> None:
    x = torch.ones(4)

    def step() -> None:
        for _ in range(3):  # three "layers" of two ops each
            torch.exp(torch.add(x, 1))

    profiled = profile_step(step, layers=3, device=torch.device("cpu"))
    assert profiled.source == "cpu-ops"
    assert profiled.kernels_per_layer == 2
    assert profiled.kernel_names == ("aten::add", "aten::exp")
    assert profiled.span_us_per_layer >= profiled.kernel_us_per_layer > 0


def test_cpu_profile_prints_nothing_of_its_own() -> None:
    """torch 2.13's kineto writes two "USDT:" lines to stderr per profile at its default log
    level; pathgate's CPU runs profile every case, so they would flood the progress lines."""
    code = (
        "import torch\n"
        "from harness.evaluation.profiling import profile_step\n"
        "profile_step(lambda: torch.ones(2) + 1, 1, torch.device('cpu'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "USDT" not in done.stderr + done.stdout
