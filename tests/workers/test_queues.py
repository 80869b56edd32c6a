"""Queues: a scope's GPU counts become one job each, on the queue of that count, and a job runs
only its count's cases; the sweeper that re-routes jobs never undoes a worker's claim."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.migrate import upgrade
from harness.submissions import Source, submit
from scopes.manifest import ScopeManifest
from tests.service_fixtures import (
    POSTGRES_URL,
    database_url,  # noqa: F401  (fixture)
    reset_postgres,
    use_database,
)
from workers.routing import gpus_of_queue, queue_name, queues_for_host, queues_for_manifest
from workers.tasks import heartbeat, start_job, sweep_jobs


def _scope(gpu: list[str], gpus: list[int]) -> dict:
    return {
        "name": "routing-rmsnorm",
        "summary": "the stock add+RMSNorm routed by GPU count",
        "path": {
            "problem": "kernels.fused_add_rmsnorm.problem:Problem",
            "baseline": "kernels.fused_add_rmsnorm.stock:forward",
            "candidate": "kernels.fused_add_rmsnorm.stock:forward",
            "supports": "tests.fixtures.bad_paths:honest_supports",
        },
        "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": 256}},
        "hardware": {"gpu": gpu, "gpus": gpus},
        "workload": {"phase": "decode", "batch": {"min": 1, "max": 8}},
    }


def test_each_gpu_count_is_a_queue_of_its_own() -> None:
    scope = ScopeManifest.model_validate(_scope(["H200", "cpu"], [4, 1, 2]))
    assert queues_for_manifest(scope) == ["gpu.h200.x1", "gpu.h200.x2", "gpu.h200.x4", "cpu"]


def test_a_queue_names_its_gpu_count() -> None:
    assert gpus_of_queue("cpu") is None
    for count in (1, 2, 8):
        assert gpus_of_queue(queue_name("H200", count)) == count


def test_a_host_serves_every_count_up_to_its_own() -> None:
    assert queues_for_host("H200", 2) == ["cpu", "gpu.h200.x1", "gpu.h200.x2"]
    assert queues_for_host("cpu", 0) == ["cpu"]


def test_a_job_of_a_multi_gpu_queue_asks_for_that_count(database_url: str) -> None:  # noqa: F811
    with session_scope() as session:
        token, _ = repo.create_token(session, "router", "contributor")
        submission = submit(
            session,
            yaml.safe_dump(_scope(["H200", "cpu"], [1, 2])),
            Source("in_tree"),
            token,
            live_queues=set(),
        )
        session.flush()
        jobs = {job.queue: job.id for job in repo.jobs_of(session, submission.id)}
    assert set(jobs) == {"gpu.h200.x1", "gpu.h200.x2", "cpu"}
    requests = {queue: start_job(job_id, "w") for queue, job_id in jobs.items()}
    assert {q: (r.request.device, r.request.gpus) for q, r in requests.items() if r} == {
        "gpu.h200.x1": ("cuda", 1),
        "gpu.h200.x2": ("cuda", 2),
        "cpu": ("cpu", None),
    }


def test_the_sweeper_never_undoes_a_workers_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job waits for hardware; a worker claims it (running) while the sweeper, seeing the
    queue served now, would put it back to queued. The sweeper waits for the claim and leaves
    the running job alone (it once overwrote it: the job then ran with nobody recording it)."""
    reset_postgres()
    use_database(monkeypatch, POSTGRES_URL)
    upgrade(POSTGRES_URL)
    with session_scope() as session:
        token, _ = repo.create_token(session, "sweeper", "contributor")
        scope = yaml.safe_dump(_scope(["cpu"], [1]))
        submission = submit(session, scope, Source("in_tree"), token, live_queues=set())
        session.flush()
        [job] = repo.jobs_of(session, submission.id)
        assert job.state == "waiting_for_hardware"
        job_id = job.id
    heartbeat("w1", ["cpu"], "cpu")
    claimed, release = threading.Event(), threading.Event()

    def claim() -> None:
        with session_scope() as session:
            job = repo.lock_job(session, job_id)
            assert job is not None
            job.state, job.worker, job.attempts = "running", "w1", 1
            session.flush()
            claimed.set()
            release.wait(10)

    with ThreadPoolExecutor(2) as pool:
        worker = pool.submit(claim)
        assert claimed.wait(10)
        sweeper = pool.submit(sweep_jobs)
        time.sleep(1)  # the sweeper now waits on the claimed row
        release.set()
        worker.result(10)
        sweeper.result(10)  # an error in the sweeper (not just a warning) fails the test
    with session_scope() as session:
        job = repo.lock_job(session, job_id)
        assert job is not None and (job.state, job.attempts) == ("running", 1)
