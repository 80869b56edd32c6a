"""The floor's bandwidth (harness.evaluation.bandwidth): the read stream reads every block once,
and the floor takes the larger of the read and the copy readings. The readings themselves need
a GPU (the `gpu` test)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.evaluation import bandwidth
from harness.evaluation.bandwidth import stream_sum_kernel

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("programs", [1, 3, 8])
def test_the_stream_sums_every_block_once(programs: int) -> None:
    data = torch.randn(16 * 64, dtype=torch.bfloat16)
    sums = torch.empty(programs)
    stream_sum_kernel()[(programs,)](data, sums, 16, BLOCK=64)
    assert sums.double().sum().item() == pytest.approx(data.double().sum().item(), abs=1e-3)
    # each program sums its own blocks: program p has blocks p, p + programs, ...
    blocks = data.float().view(16, 64).sum(1)
    for p in range(programs):
        assert sums[p].item() == pytest.approx(blocks[p::programs].sum().item(), abs=1e-3)


def test_importing_the_engine_leaves_triton_unimported() -> None:
    """The engine turns Triton's interpreter on for a CPU run after it is imported; a
    triton.language imported before that leaves its own jit helpers in compiled mode, and every
    interpreted kernel that calls tl.sum then fails (the honest Triton submission did)."""
    code = (
        "import sys; import harness.evaluation.engine, harness.cli; print('triton' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("read", "copy"), [(4.5e12, 4.2e12), (3.0e12, 4.2e12)])
def test_the_floor_takes_the_faster_reading(
    monkeypatch: pytest.MonkeyPatch, read: float, copy: float
) -> None:
    monkeypatch.setattr(bandwidth, "read_bytes_per_s", lambda index=0: read)
    monkeypatch.setattr(bandwidth, "copy_bytes_per_s", lambda index=0: copy)
    bandwidth.hbm_bytes_per_s.cache_clear()
    try:
        assert bandwidth.hbm_bytes_per_s(0) == max(read, copy)
    finally:
        bandwidth.hbm_bytes_per_s.cache_clear()


def test_a_failed_read_leaves_the_copy_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(index: int = 0) -> float:
        raise RuntimeError("no Triton for this GPU")

    monkeypatch.setattr(bandwidth, "read_bytes_per_s", no_triton)
    monkeypatch.setattr(bandwidth, "copy_bytes_per_s", lambda index=0: 4.2e12)
    bandwidth.hbm_bytes_per_s.cache_clear()
    monkeypatch.setattr(bandwidth, "_fallbacks", {})
    try:
        with pytest.warns(UserWarning, match="copy alone"):
            assert bandwidth.hbm_bytes_per_s(0) == 4.2e12
        # and the evidence will say so (the engine adds floor_warnings to its warnings)
        assert bandwidth.floor_warnings() == [
            "HBM floor from the copy alone on cuda:0: the read stream failed (no Triton for "
            "this GPU); floor fractions are more generous than the read ceiling"
        ]
    finally:
        bandwidth.hbm_bytes_per_s.cache_clear()


@pytest.mark.gpu
def test_the_readings_on_this_gpu() -> None:
    """Both readings are real rates (the read also checked that it read every block), and the
    floor is the larger. No speed threshold: docs/benchmarks.md records what they read."""
    bandwidth.hbm_bytes_per_s.cache_clear()
    read, copy = bandwidth.read_bytes_per_s(0), bandwidth.copy_bytes_per_s(0)
    assert all(math.isfinite(x) and 1e11 < x < 1e14 for x in (read, copy))
    # its own readings, a moment later: the larger of the two within the readings' noise, and
    # not a fallback to the copy
    assert bandwidth.hbm_bytes_per_s(0) >= 0.9 * max(read, copy)
    assert bandwidth.floor_warnings() == []
