"""Tasks: run one job, and sweep jobs that lost their worker or their broker message.

Retries are counted in the database (`Job.attempts`), not by Celery: a job whose child takes its
worker down is delivered again by the sweeper, and after `job_max_attempts` it ends `failed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from celery import Task
from sqlalchemy.orm import Session

from harness import submissions
from harness.config import get_settings
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import Job, utcnow
from harness.submissions import Source, manifest_file_name
from workers import gpu_health
from workers import heartbeat as worker_identity
from workers.celery_app import app, enqueue, task_time_limit_s
from workers.routing import CPU_QUEUE, gpus_of_queue
from workers.runner import (
    LOG_NAME,
    ChildCrashed,
    ChildTimedOut,
    Finished,
    RunOutcome,
    RunRequest,
    run_in_child,
)
from workers.workspace import REPO_ROOT, SourceError, prepare_source

RUNNABLE_STATES = ("queued", "waiting_for_hardware")
# A running job whose task is this far past Celery's hard limit was killed with it (the pool
# process died, its worker lives on): the sweeper gives it another attempt.
OVERDUE_MARGIN_S = 60
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartedJob:
    request: RunRequest
    workdir: Path


@app.task(name="pathgate.run_job", bind=True)
def run_job(self: Task, job_id: int) -> None:
    worker = self.request.hostname or socket.gethostname()
    started = start_job(job_id, worker)
    if started is None:
        return
    try:
        outcome = run_in_child(started.request)
    finally:
        clear_workspace(started.workdir)
    finish_job(job_id, outcome)
    if started.request.device == "cuda" and not isinstance(outcome, Finished):
        check_gpu_after_kill(job_id, worker)


def clear_workspace(workdir: Path) -> None:
    """After a run, only its log stays (the runner rewrote it, bounded, from its own handle):
    the checkout and whatever the child wrote go, so runs cannot fill the disk. Links are
    removed, never followed; folders the child made unreadable are opened up first."""
    with contextlib.suppress(FileNotFoundError), os.scandir(workdir) as entries:
        for entry in list(entries):
            if entry.name == LOG_NAME and entry.is_file(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                _open_up(entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _open_up(folder: str) -> None:
    """chmod u+rwx on the folder and every real folder under it (a worker that is not root
    could otherwise neither list nor empty one the child set to 000)."""
    with contextlib.suppress(OSError):
        os.chmod(folder, 0o700)
    for root, folders, _ in os.walk(folder):
        for name in folders:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)


def check_gpu_after_kill(job_id: int, worker: str) -> None:
    """A GPU job's child was killed or crashed: before this worker takes another job, the GPU
    must pass a health check; if it does not, the worker stops (its queue shows as unserved)."""
    health = gpu_health.check_gpu()
    with session_scope() as session:
        repo.record_audit(
            session,
            worker,
            "worker.gpu_check" if health.healthy else "worker.gpu_unhealthy",
            f"job:{job_id}",
            {"healthy": health.healthy, "detail": health.detail},
        )
    if not health.healthy:
        log.error("GPU unhealthy after job %s: %s; this worker stops", job_id, health.detail)
        stop_worker()


def stop_worker() -> None:
    """A warm shutdown of the whole worker: it finishes this task and takes no other."""
    identity = worker_identity.identity
    main_pid = identity.main_pid if identity else os.getpid()
    os.kill(main_pid, signal.SIGTERM)


def start_job(job_id: int, worker: str) -> StartedJob | None:
    """Claim the job for this worker (one attempt more) and fetch its source, or None if it must
    not run. The claim commits before the checkout, which may take minutes: no transaction (on
    SQLite, the database's write lock) is held while git fetches."""
    claim = _claim(job_id, worker)
    if claim is None:
        return None
    # A fresh workspace: nothing an earlier run left at this path may reach this one.
    shutil.rmtree(claim.workdir, ignore_errors=True)
    try:
        source_dir = prepare_source(
            claim.source, claim.workdir / "src", get_settings().git_protocols
        )
    except SourceError as exc:
        _end_claim(job_id, worker, claim.attempt, "error", str(exc))
        return None
    return StartedJob(replace(claim.request, source_dir=source_dir), claim.workdir)


@dataclass(frozen=True)
class Claim:
    request: RunRequest  # its source_dir is the repository's until the checkout replaces it
    source: Source
    attempt: int
    workdir: Path


def _claim(job_id: int, worker: str) -> Claim | None:
    """The job marked running on this worker, or None if it must not run here."""
    settings = get_settings()
    with session_scope() as session:
        job = repo.lock_job(session, job_id)
        if job is None or not _runnable_here(job, worker):
            return None  # finished, or a duplicate delivery while another worker runs it
        if job.attempts >= settings.job_max_attempts:
            submissions.record_failure(
                session,
                job,
                "failed",
                f"the job ended its worker {job.attempts} times; not retried",
                job.log_tail or "",
            )
            _refresh(session, job)
            return None
        job.attempts += 1
        job.state, job.worker, job.started_at, job.reason = "running", worker, utcnow(), None
        _refresh(session, job)
        submission = repo.get_submission(session, job.submission_id, owner_id=None)
        assert submission is not None
        kind = submission.source_kind
        source = Source(kind, submission.source_url, submission.source_sha)  # type: ignore[arg-type]
        workdir = settings.work_dir / f"job-{job.id}-attempt-{job.attempts}"
        request = RunRequest(
            manifest_yaml=submission.manifest_text,
            source_dir=REPO_ROOT,
            # the queue names the hardware: a GPU host serving `cpu` runs those jobs on its CPU
            device="cpu" if job.queue == CPU_QUEUE else "cuda",
            gpus=gpus_of_queue(job.queue),
            timeout_s=settings.job_timeout_s,
            workdir=workdir,
            scope_path=manifest_file_name(submission.id),
        )
        return Claim(request, source, job.attempts, workdir)


def _end_claim(job_id: int, worker: str, attempt: int, state: str, reason: str) -> None:
    """End this worker's attempt without evidence, unless the job moved on meanwhile (a sweeper
    gave it to another worker)."""
    with session_scope() as session:
        job = repo.lock_job(session, job_id)
        if job is None or (job.state, job.worker, job.attempts) != ("running", worker, attempt):
            return
        submissions.record_failure(session, job, state, reason, job.log_tail or "")
        _refresh(session, job)


def _runnable_here(job: Job, worker: str) -> bool:
    # A worker runs one job at a time, so a job already "running" on this very worker that is
    # delivered to it again lost its previous run (its pool process died): run it again.
    return job.state in RUNNABLE_STATES or (job.state == "running" and job.worker == worker)


def finish_job(job_id: int, outcome: RunOutcome) -> None:
    """Store the child's outcome. If storing it fails (a database error), the job still ends,
    as an error that says so, rather than stay "running" with nobody to finish it."""
    try:
        _record_outcome(job_id, outcome)
    except Exception as exc:
        log.exception("job %s: its outcome could not be stored", job_id)
        reason = f"the result could not be stored: {type(exc).__name__}: {exc}"[:1000]
        with session_scope() as session:
            job = repo.lock_job(session, job_id)
            if job is not None and job.state == "running":
                submissions.record_failure(session, job, "error", reason, outcome.log_tail)
                _refresh(session, job)


def _record_outcome(job_id: int, outcome: RunOutcome) -> None:
    with session_scope() as session:
        job = repo.lock_job(session, job_id)
        if job is None or job.state != "running":
            return  # a sweeper gave it to another worker meanwhile; that run records it
        match outcome:
            case Finished(evidence=evidence, log_tail=log):
                submissions.record_evidence(session, job, evidence, log)
            case ChildTimedOut(after_s=after_s, log_tail=log):
                submissions.record_failure(
                    session, job, "timed_out", f"killed after its {after_s:.0f} s limit", log
                )
            case ChildCrashed(error=error, exit_code=code, log_tail=log):
                submissions.record_failure(
                    session, job, "error", f"the evaluation crashed (exit {code}): {error}", log
                )
        _refresh(session, job)


def _refresh(session: Session, job: Job) -> None:
    submission = repo.lock_submission(session, job.submission_id)
    submissions.refresh_state(session, submission)


@app.task(name="pathgate.sweep")
def sweep() -> None:
    sweep_jobs()


def sweep_jobs() -> None:
    """Requeue jobs whose worker died or whose message was lost; mark jobs no worker serves."""
    settings = get_settings()
    with session_scope() as session:
        submissions.install_enqueue_hook(session, enqueue)
        live = repo.live_workers(session, settings.worker_stale_after_s)
        queues = repo.live_queues(session, settings.worker_stale_after_s)
        overdue = utcnow() - timedelta(seconds=task_time_limit_s(settings) + OVERDUE_MARGIN_S)
        for job in repo.jobs_in_state(session, "running"):
            if job.worker not in live:
                _requeue(session, job, f"worker {job.worker} stopped answering")
        for job in repo.jobs_in_state(session, "running", started_before=overdue):
            _requeue(session, job, "ran past its task's time limit; its worker lives on")
        stale = utcnow() - timedelta(seconds=settings.requeue_after_s)
        for job in repo.jobs_in_state(session, "queued", before=stale):
            _requeue(session, job, "enqueued again: no worker took it in time")
        for job in repo.jobs_in_state(session, "queued") + repo.jobs_in_state(
            session, "waiting_for_hardware"
        ):
            _mark_hardware(session, job, queues)


def _requeue(session: Session, job: Job, reason: str) -> None:
    job.state, job.reason = "queued", reason
    submissions.enqueue_after_commit(session, job)
    _refresh(session, job)


def _mark_hardware(session: Session, job: Job, live_queues: set[str]) -> None:
    served = job.queue in live_queues
    if job.state == "queued" and not served:
        job.state, job.reason = "waiting_for_hardware", f"no live worker serves queue {job.queue}"
    elif job.state == "waiting_for_hardware" and served:
        job.state, job.reason = "queued", None
    else:
        return
    _refresh(session, job)


def heartbeat(worker: str, queues: list[str], hardware: str) -> None:
    with session_scope() as session:
        repo.beat(session, worker, queues, hardware)
