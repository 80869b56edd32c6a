"""The floor's bandwidth (harness.evaluation.bandwidth): the read stream reads every block once,
and the floor takes the larger of the read and the copy readings. The readings themselves need
a GPU (the `gpu` test)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.evaluation import bandwidth
from harness.evaluation.bandwidth import stream_sum_kernel


@pytest.mark.parametrize("programs", [1, 3, 8])
def test_the_stream_sums_every_block_once(programs: int) -> None:
    data = torch.randn(16 * 64, dtype=torch.bfloat16)
    sums = torch.empty(programs)
    stream_sum_kernel[(programs,)](data, sums, 16, BLOCK=64)
    assert sums.double().sum().item() == pytest.approx(data.double().sum().item(), abs=1e-3)
    # each program sums its own blocks: program p has blocks p, p + programs, ...
    blocks = data.float().view(16, 64).sum(1)
    for p in range(programs):
        assert sums[p].item() == pytest.approx(blocks[p::programs].sum().item(), abs=1e-3)


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


@pytest.mark.gpu
def test_the_readings_on_this_gpu() -> None:
    """Both readings are real rates (the read also checked that it read every block), and the
    floor is the larger. No speed threshold: docs/benchmarks.md records what they read."""
    bandwidth.hbm_bytes_per_s.cache_clear()
    read, copy = bandwidth.read_bytes_per_s(0), bandwidth.copy_bytes_per_s(0)
    assert all(math.isfinite(x) and 1e11 < x < 1e14 for x in (read, copy))
    assert bandwidth.hbm_bytes_per_s(0) >= min(read, copy)
