"""A job's way from claim to stored result on both databases, where it used to get stuck: a
result PostgreSQL refused, a database error while storing, a checkout that held the claim's
transaction, a broker that was down when the job was sent, a task killed at its hard limit."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from harness import submissions
from harness.config import get_settings
from harness.evaluation.evidence import Evidence
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import CaseResult, Job, Report, utcnow
from harness.submissions import Source, install_enqueue_hook, submit
from tests.service_fixtures import database_url  # noqa: F401  (fixture)
from tests.workers.test_queues import _scope
from workers import tasks
from workers.celery_app import task_time_limit_s
from workers.runner import Finished
from workers.workspace import REPO_ROOT, SourceError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SCOPE = _scope(["cpu"], [1])  # the stock add+RMSNorm as its own candidate, a cpu job


def _new_job(enqueue: object = None) -> int:
    """One submission with one cpu job, sent with `enqueue` (a no-op by default)."""
    sent = enqueue or (lambda job_id, queue: None)
    with session_scope(lambda s: install_enqueue_hook(s, sent)) as session:  # type: ignore[arg-type]
        token, _ = repo.create_token(session, "lifecycle", "contributor")
        submission = submit(session, yaml.safe_dump(SCOPE), Source("in_tree"), token, {"cpu"})
        session.flush()
        [job] = repo.jobs_of(session, submission.id)
        return job.id


def _job(job_id: int) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _evidence_with_an_infinite_error() -> Evidence:
    evidence = Evidence.model_validate_json((FIXTURES / "evidence_cpu_rmsnorm.json").read_text())
    output = evidence.cases[0].correctness.trials[0].outputs[0]  # type: ignore[union-attr]
    output.candidate_error = output.error_ratio = math.inf
    evidence.verdict_reasons = ["a reason a candidate wrote, with a NUL: \x00 here"]
    return evidence


def test_a_result_with_an_infinite_error_and_nul_bytes_is_stored(database_url: str) -> None:  # noqa: F811
    job_id = _new_job()
    assert tasks.start_job(job_id, "w1") is not None
    log = "the candidate printed\x00a NUL"
    tasks.finish_job(job_id, Finished(_evidence_with_an_infinite_error(), log))
    job = _job(job_id)
    assert job.state == "inconclusive"  # the fixture's verdict, stored
    assert job.log_tail == "the candidate printed\ufffda NUL"
    assert job.reason is not None and "\x00" not in job.reason
    with session_scope() as session:
        report = session.scalar(select(Report).where(Report.job_id == job_id))
        rows = session.scalars(select(CaseResult).where(CaseResult.job_id == job_id)).all()
        assert report is not None and "\x00" not in report.markdown
        stored = Evidence.model_validate(report.evidence)  # the infinity reads back as a float
        assert stored.cases[0].correctness.trials[0].outputs[0].error_ratio == math.inf  # type: ignore[union-attr]
        first = next(row for row in rows if row.case_id == stored.cases[0].id)
        assert first.correctness is not None
        assert first.correctness["trials"][0]["outputs"][0]["error_ratio"] == "Infinity"


def test_the_jobs_reason_says_how_many_reasons_it_leaves_to_the_report(
    database_url: str,  # noqa: F811
) -> None:
    """It showed three of four unmeasurable claims as if they were all."""
    job_id = _new_job()
    assert tasks.start_job(job_id, "w1") is not None
    evidence = Evidence.model_validate_json((FIXTURES / "evidence_cpu_rmsnorm.json").read_text())
    evidence.verdict_reasons = [f"claim {n} not measurable" for n in range(1, 5)]
    tasks.finish_job(job_id, Finished(evidence, ""))
    assert _job(job_id).reason == (
        "claim 1 not measurable; claim 2 not measurable; claim 3 not measurable; "
        "and 1 more in the report"
    )


def test_a_result_that_cannot_be_stored_ends_the_job_as_an_error(
    database_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = _new_job()
    assert tasks.start_job(job_id, "w1") is not None

    def disk_full(*_: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(submissions, "record_evidence", disk_full)
    evidence = Evidence.model_validate_json((FIXTURES / "evidence_cpu_rmsnorm.json").read_text())
    tasks.finish_job(job_id, Finished(evidence, "log"))
    job = _job(job_id)
    assert job.state == "error"
    assert job.reason == "the result could not be stored: RuntimeError: disk full"
    assert job.finished_at is not None and job.log_tail == "log"


def test_the_claim_commits_before_the_checkout(
    database_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While git fetches, other sessions see the job running and can write (on SQLite a held
    claim transaction kept the write lock: every API write failed after 30 s)."""
    job_id = _new_job()
    seen: list[str] = []

    def checkout(source: Source, dest: Path, protocols: object) -> Path:
        with session_scope() as session:
            repo.create_token(session, "written during the checkout", "contributor")
            job = session.get(Job, job_id)
            assert job is not None
            seen.append(job.state)
        return REPO_ROOT

    monkeypatch.setattr(tasks, "prepare_source", checkout)
    started = tasks.start_job(job_id, "w1")
    assert started is not None and started.request.source_dir == REPO_ROOT
    assert seen == ["running"]


def test_a_failed_checkout_ends_the_attempt_as_an_error(
    database_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = _new_job()

    def checkout(source: Source, dest: Path, protocols: object) -> Path:
        raise SourceError("git fetch failed for https://example.invalid/x at 0123")

    monkeypatch.setattr(tasks, "prepare_source", checkout)
    assert tasks.start_job(job_id, "w1") is None
    job = _job(job_id)
    assert (job.state, job.attempts) == ("error", 1)
    assert job.reason == "git fetch failed for https://example.invalid/x at 0123"


def test_a_job_the_broker_never_got_is_sent_again_by_the_sweeper(
    database_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broker_down(job_id: int, queue: str) -> None:
        raise ConnectionError("broker unreachable")

    job_id = _new_job(broker_down)  # no exception: the submission is stored
    job = _job(job_id)
    assert job.state == "queued" and job.enqueued_at is not None
    sent: list[tuple[int, str]] = []
    monkeypatch.setattr(tasks, "enqueue", lambda job_id, queue: sent.append((job_id, queue)))
    tasks.heartbeat("w1", ["cpu"], "cpu")
    tasks.sweep_jobs()
    assert sent == []  # not yet: a queued job gets requeue_after_s before it is sent again
    monkeypatch.setenv("PATHGATE_REQUEUE_AFTER_S", "0")
    get_settings.cache_clear()
    tasks.sweep_jobs()
    assert sent == [(job_id, "cpu")]
    assert _job(job_id).reason == "enqueued again: no worker took it in time"


def test_a_running_job_past_its_tasks_hard_limit_is_given_another_attempt(
    database_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Celery's hard limit kills the pool process, not the worker, whose heartbeat goes on: the
    job's run is gone, and only its age tells."""
    overdue, recent = _new_job(), _new_job()
    for job_id in (overdue, recent):
        assert tasks.start_job(job_id, "w1") is not None
    limit = task_time_limit_s(get_settings()) + tasks.OVERDUE_MARGIN_S
    with session_scope() as session:
        job = session.get(Job, overdue)
        assert job is not None
        job.started_at = utcnow() - timedelta(seconds=limit + 60)
    sent: list[tuple[int, str]] = []
    monkeypatch.setattr(tasks, "enqueue", lambda job_id, queue: sent.append((job_id, queue)))
    tasks.heartbeat("w1", ["cpu"], "cpu")
    tasks.sweep_jobs()
    assert sent == [(overdue, "cpu")]
    assert (_job(overdue).state, _job(overdue).reason) == (
        "queued",
        "ran past its task's time limit; its worker lives on",
    )
    assert _job(recent).state == "running"
