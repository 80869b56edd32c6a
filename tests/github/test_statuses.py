"""Verdict statuses: the state mapping, a pending status while no worker serves a job's hardware,
GitHub's length limits, retries after a rate-limit answer (waiting the time GitHub names), and
`pathgate github sync` re-posting what failed."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from harness import submissions as submission_service
from harness.cli import app as cli
from harness.github.hooks import VERDICT_TASK
from harness.github.models import StatusPosting
from harness.github.statuses import SUMMARY_MAX, truncate_summary
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import Job, WorkerHeartbeat, utcnow
from tests.github.conftest import JobRecorder, TaskRecorder, deliver
from tests.github.fake_github import FakeGitHub
from tests.github.test_pull_requests import open_pull_request, run_github_tasks, submissions
from workers.tasks import sweep_jobs

CONTEXT = "pathgate/contrib-rmsnorm-cpu"


def _finish_without_evidence(state: str, reason: str) -> int:
    """End the only submission's job the way a crash, a timeout or a killed worker does."""
    with session_scope() as session:
        job = session.scalars(select(Job)).one()
        submission_service.record_failure(session, job, state, reason, "")
        submission = repo.lock_submission(session, job.submission_id)
        submission_service.refresh_state(session, submission)
        return submission.id


def _statuses(fake: FakeGitHub, context: str = CONTEXT) -> list[dict]:
    return [c.body for c in fake.posted("statuses") if c.body["context"] == context]


@pytest.mark.parametrize(
    ("job_state", "status", "label"),
    [
        ("error", "error", "error"),
        ("timed_out", "error", "timed out"),
        ("failed", "failure", "FAIL"),
    ],
)
def test_a_verdict_without_evidence_maps_to_its_status(
    client: TestClient,
    tasks: TaskRecorder,
    fake_token: FakeGitHub,
    tmp_path: Path,
    job_state: str,
    status: str,
    label: str,
) -> None:
    deliver(client, "pull_request", open_pull_request(tmp_path, fake_token).payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    submission_id = _finish_without_evidence(job_state, "x" * 300)
    assert tasks.sent == [(VERDICT_TASK, submission_id)]
    run_github_tasks(tasks, JobRecorder())
    final = _statuses(fake_token)[-1]
    assert final["state"] == status
    assert final["description"].startswith(f"{label}: cpu: xxx")
    assert len(final["description"]) == 140 and final["description"].endswith("…")
    assert fake_token.problems == []


def _worker_serving_cpu(alive: bool) -> None:
    with session_scope() as session:
        repo.beat(session, "cpu-worker", ["cpu"], "cpu")
        heartbeat = session.get(WorkerHeartbeat, "cpu-worker")
        assert heartbeat is not None
        heartbeat.last_seen = utcnow() - timedelta(hours=0 if alive else 1)


def test_a_job_no_worker_serves_shows_as_waiting_on_the_pull_request_not_as_queued(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    _worker_serving_cpu(alive=True)
    deliver(client, "pull_request", open_pull_request(tmp_path, fake_token).payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    [submission] = submissions()
    assert _statuses(fake_token)[-1]["description"] == f"submission {submission.id}: queued"

    _worker_serving_cpu(alive=False)  # the only cpu worker stops answering
    sweep_jobs()
    assert tasks.sent == [(VERDICT_TASK, submission.id)]
    run_github_tasks(tasks, JobRecorder())
    waiting = _statuses(fake_token)[-1]
    assert waiting["state"] == "pending"
    assert waiting["description"] == "waiting for hardware: cpu: no live worker serves queue cpu"
    assert waiting["target_url"].endswith(f"/dashboard/submissions/{submission.id}")
    sweep_jobs()  # still waiting: nothing new to say
    assert tasks.sent == []

    _worker_serving_cpu(alive=True)
    sweep_jobs()
    run_github_tasks(tasks, JobRecorder())
    assert (_statuses(fake_token)[-1]["state"], _statuses(fake_token)[-1]["description"]) == (
        "pending",
        "queued: cpu: queued",
    )
    _finish_without_evidence("error", "the evaluation crashed")
    run_github_tasks(tasks, JobRecorder())
    assert [s["state"] for s in _statuses(fake_token)] == ["pending"] * 3 + ["error"]
    assert fake_token.posted("check-runs") == []  # token auth: statuses only
    assert fake_token.problems == []


def test_a_submission_not_from_github_posts_nothing(
    client: TestClient, tasks: TaskRecorder
) -> None:
    with session_scope() as session:
        token, _ = repo.create_token(session, "alice", "contributor")
        manifest = (Path(__file__).parents[2] / "scopes/fused-add-rmsnorm-h200.yaml").read_text()
        source = submission_service.Source("in_tree")
        submission_service.submit(session, manifest, source, token, set())
    for job_id in [job.id for job in _jobs()]:
        with session_scope() as session:
            job = session.get(Job, job_id)
            assert job is not None
            submission_service.record_failure(session, job, "error", "boom", "")
            submission_service.refresh_state(
                session, repo.lock_submission(session, job.submission_id)
            )
    assert tasks.sent == []


def _jobs() -> list[Job]:
    with session_scope() as session:
        return list(session.scalars(select(Job)))


def test_a_long_report_is_truncated_to_githubs_limit_with_a_note() -> None:
    summary = truncate_summary("x" * 70_000, "https://pathgate.example/r")
    assert len(summary) <= SUMMARY_MAX
    assert summary.rstrip().endswith("The full report: https://pathgate.example/r*")
    assert truncate_summary("short", None) == "short"


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (429, {"retry-after": "1"}),
        (403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "RESET"}),
    ],
)
def test_a_rate_limit_answer_is_retried_after_the_time_github_names(
    client: TestClient,
    tasks: TaskRecorder,
    fake_token: FakeGitHub,
    tmp_path: Path,
    status: int,
    headers: dict[str, str],
) -> None:
    reset = str(int(time.time()) + 2)  # at most 2 s from now; pathgate waits at least 1 s
    fake_token.rate_limit_once(
        "/statuses/", status, {k: v.replace("RESET", reset) for k, v in headers.items()}
    )
    deliver(client, "pull_request", open_pull_request(tmp_path, fake_token).payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    first, second = [c for c in fake_token.posted("statuses")][:2]
    assert first.body == second.body  # the same status, sent again
    assert second.at - first.at >= 1.0
    with session_scope() as session:
        rows = list(session.scalars(select(StatusPosting)))
        assert all(r.posted_at is not None and r.last_error is None for r in rows)


def test_sync_reposts_failed_postings_and_unposted_verdicts(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    # an hour's wait is not spent inside a task: the posting fails and is recorded
    fake_token.rate_limit_once("/statuses/", 429, {"retry-after": "3600"})
    deliver(client, "pull_request", open_pull_request(tmp_path, fake_token).payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    with session_scope() as session:
        failed = session.scalars(
            select(StatusPosting).where(StatusPosting.posted_at.is_(None))
        ).one()
        assert failed.attempts == 1 and "HTTP 429" in (failed.last_error or "")
    # and a verdict whose task message was lost
    _finish_without_evidence("error", "the evaluation crashed")
    tasks.sent.clear()

    result = CliRunner().invoke(cli, ["github", "sync"])
    assert result.exit_code == 0, result.output
    assert "posted 2 status(es); 0 still failing" in result.output
    # the rate-limited pending status, the same again from sync, then the verdict
    assert [s["state"] for s in _statuses(fake_token)] == ["pending", "pending", "error"]
    with session_scope() as session:
        assert (
            session.scalars(select(StatusPosting).where(StatusPosting.posted_at.is_(None))).all()
            == []
        )
    assert len(submissions()) == 1
