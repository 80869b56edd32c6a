"""The service end to end on the real PostgreSQL and Redis: the API stores a submission, a real
Celery worker (a separate process) consumes it from Redis, runs the evaluation in a child process
and stores the evidence, which the API then serves. Also: a worker killed mid-job, a job that
kills its worker every time, and a job that hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from harness.api.app import create_app
from harness.config import Settings
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.migrate import upgrade
from harness.store.models import FINISHED_STATES, CaseResult, Job, Report
from tests.service_fixtures import POSTGRES_URL, REDIS_URL, reset_postgres, use_database
from workers.celery_app import make_celery
from workers.runner import isolation

REPO_ROOT = Path(__file__).resolve().parents[2]
# The redone job of the killed-worker test sleeps 8 s in its fresh process, then validates: 25 s
# left too little room on a loaded 2-core CI machine (it timed out there once, 2026-12-06)
JOB_TIMEOUT_S = 45


def cpu_scope(candidate: str) -> str:
    return yaml.safe_dump(
        {
            "name": "e2e-rmsnorm-cpu",
            "summary": "the stock add+RMSNorm as a candidate, on CPU",
            "path": {
                "problem": "kernels.fused_add_rmsnorm.problem:Problem",
                "baseline": "kernels.fused_add_rmsnorm.stock:forward",
                "candidate": candidate,
                "supports": "tests.fixtures.bad_paths:honest_supports",
            },
            "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": 256}},
            "hardware": {"gpu": ["cpu"], "gpus": [1]},
            "workload": {"phase": "decode", "batch": {"min": 1, "max": 64}},
            "claims": [],
        }
    )


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    """PostgreSQL and Redis, as deployed."""
    reset_postgres()
    monkeypatch.setenv("PATHGATE_RATE_LIMIT_PER_MINUTE", "100000")  # the test polls often
    use_database(monkeypatch, POSTGRES_URL)
    upgrade(POSTGRES_URL)
    redis.Redis.from_url(REDIS_URL).flushdb()
    service = Service(tmp_path, POSTGRES_URL, REDIS_URL)
    yield service
    service.stop_all()


@pytest.fixture
def embedded_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    """The defaults a new user gets: a SQLite file and the embedded (SQLite-backed) broker."""
    database = f"sqlite:///{tmp_path / 'pathgate.db'}"
    monkeypatch.setenv("PATHGATE_RATE_LIMIT_PER_MINUTE", "100000")
    use_database(monkeypatch, database)
    upgrade(database)
    service = Service(tmp_path, database, f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    yield service
    service.stop_all()


class Service:
    def __init__(self, tmp_path: Path, database_url: str, broker_url: str) -> None:
        self.tmp_path, self.database_url, self.broker_url = tmp_path, database_url, broker_url
        self.workers: list[subprocess.Popen[bytes]] = []
        settings = Settings(database_url=database_url, broker_url=broker_url)
        celery = make_celery(settings)
        self.client = TestClient(
            create_app(
                enqueue=lambda job_id, queue: celery.send_task(
                    "pathgate.run_job", args=[job_id], queue=queue
                )
            )
        )
        with session_scope() as session:
            _, token = repo.create_token(session, "e2e", "contributor")
        self.headers = {"Authorization": f"Bearer {token}"}

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PATHGATE_DATABASE_URL": self.database_url,
            "PATHGATE_BROKER_URL": self.broker_url,
            "PATHGATE_WORKER_HEARTBEAT_S": "1",
            "PATHGATE_WORKER_STALE_AFTER_S": "4",
            "PATHGATE_JOB_TIMEOUT_S": str(JOB_TIMEOUT_S),
            "PATHGATE_WORKER_HARDWARE": "cpu",
            "PATHGATE_WORK_DIR": str(self.tmp_path / "work"),
            "PYTHONPATH": str(REPO_ROOT),
        }
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", "worker", "--queues", "cpu"],
            env=env,
            cwd=self.tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers.append(process)
        wait_for(lambda: bool(self.live_queues()), 60, f"{name} to beat")
        return process

    def live_queues(self) -> set[str]:
        with session_scope() as session:
            return repo.live_queues(session, 4)

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop_all(self) -> None:
        for process in self.workers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def submit(self, candidate: str) -> int:
        response = self.client.post(
            "/v1/submissions",
            json={"manifest": cpu_scope(candidate), "source": {"kind": "in_tree"}},
            headers=self.headers,
        )
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def submission(self, submission_id: int) -> dict:
        return self.client.get(f"/v1/submissions/{submission_id}", headers=self.headers).json()

    def wait_finished(self, submission_id: int, timeout_s: float = 150) -> dict:
        finished = set(FINISHED_STATES)
        wait_for(
            lambda: self.submission(submission_id)["state"] in finished,
            timeout_s,
            f"submission {submission_id} to finish",
            self.logs,
        )
        return self.submission(submission_id)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in self.tmp_path.glob("*.log"))


def wait_for(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    logs: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{logs() if logs else ''}")


def _counts(submission_id: int) -> tuple[int, int, int]:
    with session_scope() as session:
        jobs = select(Job.id).where(Job.submission_id == submission_id)
        reports = session.scalar(
            select(func.count()).select_from(Report).where(Report.job_id.in_(jobs))
        )
        results = session.scalar(
            select(func.count()).select_from(CaseResult).where(CaseResult.job_id.in_(jobs))
        )
        attempts = session.scalar(
            select(func.sum(Job.attempts)).where(Job.submission_id == submission_id)
        )
    return int(reports or 0), int(results or 0), int(attempts or 0)


def test_submission_runs_on_a_real_worker_and_its_report_is_served(service: Service) -> None:
    service.start_worker("w1")
    submission_id = service.submit("tests.fixtures.bad_paths:honest_forward")
    body = service.wait_finished(submission_id)
    assert body["state"] == "passed", body
    assert body["verdict"] == "PASS"
    job = body["jobs"][0]
    assert (job["queue"], job["attempts"]) == ("cpu", 1)
    assert job["worker"].startswith("pathgate-")
    report = service.client.get(
        f"/v1/submissions/{submission_id}/report.json", headers=service.headers
    ).json()
    evidence = report["jobs"][0]["evidence"]
    assert evidence["verdict"] == "PASS" and evidence["cases"]
    assert all(c["performance"]["stock_us"] for c in evidence["cases"])
    markdown = service.client.get(
        f"/v1/submissions/{submission_id}/report.md", headers=service.headers
    ).text
    assert "**PASS**" in markdown and "--seed" in markdown
    # the reproduce command names the submitted manifest's download, which is the text run
    manifest_name = f"submission-{submission_id}.yaml"
    assert evidence["run"]["command"].startswith(f"pathgate validate {manifest_name} ")
    assert f"`GET /v1/submissions/{submission_id}/manifest.yaml`" in markdown
    download = service.client.get(
        f"/v1/submissions/{submission_id}/manifest.yaml", headers=service.headers
    )
    assert f'filename="{manifest_name}"' in download.headers["content-disposition"]
    assert download.text == cpu_scope("tests.fixtures.bad_paths:honest_forward")
    reports, results, _ = _counts(submission_id)
    assert reports == 1
    assert results == len(evidence["cases"]) + len(evidence["probes"])


def test_the_same_flow_on_the_embedded_defaults(embedded_service: Service) -> None:
    embedded_service.start_worker("w1")
    submission_id = embedded_service.submit("tests.fixtures.bad_paths:honest_forward")
    body = embedded_service.wait_finished(submission_id)
    assert (body["state"], body["verdict"]) == ("passed", "PASS"), body
    report = embedded_service.client.get(
        f"/v1/submissions/{submission_id}/report.json", headers=embedded_service.headers
    ).json()
    assert report["jobs"][0]["evidence"]["verdict"] == "PASS"


def test_worker_killed_mid_job_the_job_is_redone_and_stored_once(service: Service) -> None:
    first = service.start_worker("w1")
    submission_id = service.submit("tests.fixtures.service_paths:slow_once_forward")
    wait_for(lambda: service.submission(submission_id)["state"] == "running", 60, "running")
    time.sleep(2)
    service.kill(first)
    service.start_worker("w2")
    body = service.wait_finished(submission_id)
    assert body["state"] == "passed", body
    reports, results, attempts = _counts(submission_id)
    assert (reports, attempts) == (1, 2)
    assert results > 0


def test_a_job_that_keeps_ending_its_worker_ends_failed(service: Service) -> None:
    """Its worker dies under every attempt (as the OOM killer would take it): after three, the
    job is not retried. The candidate itself cannot do this any more (next test), so the test
    kills each worker while the job runs on it."""
    submission_id = service.submit("tests.fixtures.service_paths:hangs_forward")
    for attempt in (1, 2, 3):
        worker = service.start_worker(f"w{attempt}")
        wait_for(
            lambda attempt=attempt: _running_attempt(service, submission_id) == attempt,
            90,
            f"attempt {attempt} to run",
            service.logs,
        )
        service.kill(worker)
    service.start_worker("w4")
    body = service.wait_finished(submission_id, timeout_s=180)
    assert body["state"] == "failed", body
    job = body["jobs"][0]
    assert job["attempts"] == 3
    assert "ended its worker 3 times" in job["reason"]
    assert _counts(submission_id)[0] == 0


def test_a_candidate_cannot_kill_its_worker(service: Service) -> None:
    """The child runs in its own PID namespace: the worker is not there to be signalled."""
    if not isolation().processes:
        pytest.skip("no PID namespace on this OS: the candidate can reach its worker")
    worker = service.start_worker("w1")
    submission_id = service.submit("tests.fixtures.service_paths:kills_worker_forward")
    body = service.wait_finished(submission_id, timeout_s=120)
    assert body["state"] == "error", body
    assert body["jobs"][0]["attempts"] == 1
    assert worker.poll() is None, "the worker died"


def _running_attempt(service: Service, submission_id: int) -> int:
    job = service.submission(submission_id)["jobs"][0]
    return int(job["attempts"]) if job["state"] == "running" else 0


def test_a_job_that_hangs_is_killed_at_its_limit(service: Service) -> None:
    service.start_worker("w1")
    submission_id = service.submit("tests.fixtures.service_paths:hangs_forward")
    started = time.monotonic()
    body = service.wait_finished(submission_id)
    assert body["state"] == "timed_out", body
    assert f"killed after its {JOB_TIMEOUT_S} s limit" in body["jobs"][0]["reason"]
    assert time.monotonic() - started < JOB_TIMEOUT_S + 60
