"""The GPU health check a worker runs after a GPU job's child was killed or crashed.

The check's decisions are tested with stand-in check scripts (real processes that print what the
real check prints, hang, crash or report a wrong matmul); the real script runs under `gpu`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from harness.store.db import session_scope
from harness.store.models import AuditEvent
from workers import gpu_health, tasks
from workers.gpu_health import GpuHealth, check_gpu

GIB = 2**30


def fake_check(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "check.py"
    script.write_text(body)
    return [sys.executable, str(script)]


def reporting(error: float, free: int, total: int = 80 * GIB) -> str:
    result = {"relative_error": error, "free_bytes": free, "total_bytes": total, "device": "fake"}
    return f"print({json.dumps(result)!r})\n"


def test_a_right_matmul_and_free_memory_is_healthy(tmp_path: Path) -> None:
    health = check_gpu(fake_check(tmp_path, reporting(1e-7, 79 * GIB)), attempts=1)
    assert health.healthy, health.detail
    assert "79.0 GiB free" in health.detail


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (reporting(0.3, 79 * GIB), "matmul on the GPU is wrong"),
        (reporting(1e-7, 10 * GIB), "only 10.0 of 80.0 GiB free"),
        ("import sys; sys.exit('CUDA error: an illegal memory access')\n", "exit 1"),
        ("print('no json here')\n", "printed no result"),
        ("import time; time.sleep(60)\n", "did not finish in 1 s"),
    ],
    ids=["wrong-matmul", "memory-held", "crash", "garbage", "hang"],
)
def test_an_unfit_gpu_is_unhealthy_with_the_reason(
    tmp_path: Path, body: str, expected: str
) -> None:
    health = check_gpu(fake_check(tmp_path, body), timeout_s=1.0, attempts=1)
    assert not health.healthy
    assert expected in health.detail


def test_memory_that_comes_back_on_a_retry_is_healthy(tmp_path: Path) -> None:
    # the first attempt sees memory still held; the second sees it freed
    counter = tmp_path / "attempts"
    body = (
        "from pathlib import Path\n"
        f"p = Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        f"free = {GIB} if n == 0 else {79 * GIB}\n"
        "import json\n"
        "print(json.dumps({'relative_error': 0.0, 'free_bytes': free,"
        f" 'total_bytes': {80 * GIB}, 'device': 'fake'}}))\n"
    )
    health = check_gpu(fake_check(tmp_path, body), attempts=3, retry_after_s=0.0)
    assert health.healthy, health.detail
    assert counter.read_text() == "2"


@pytest.mark.parametrize("healthy", [True, False], ids=["healthy", "unhealthy"])
def test_after_a_kill_the_check_is_recorded_and_an_unhealthy_gpu_stops_the_worker(
    database_url: str, monkeypatch: pytest.MonkeyPatch, healthy: bool
) -> None:
    stopped: list[bool] = []
    verdict = GpuHealth(healthy, "stand-in check")
    monkeypatch.setattr(gpu_health, "check_gpu", lambda: verdict)
    monkeypatch.setattr(tasks, "stop_worker", lambda: stopped.append(True))
    tasks.check_gpu_after_kill(42, "worker-1")
    with session_scope() as session:
        events = session.scalars(select(AuditEvent)).all()
    assert [(e.actor, e.subject, e.detail["healthy"]) for e in events] == [
        ("worker-1", "job:42", healthy)
    ]
    assert events[0].action == ("worker.gpu_check" if healthy else "worker.gpu_unhealthy")
    assert stopped == ([] if healthy else [True])


@pytest.mark.gpu
def test_the_real_check_passes_on_an_idle_gpu() -> None:
    health = check_gpu(attempts=1)
    assert health.healthy, health.detail
