"""Every query pathgate makes. Functions take a Session and never commit."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from harness.store.models import (
    ApiToken,
    AuditEvent,
    CaseResult,
    EnvironmentFingerprint,
    Job,
    Report,
    ServingResult,
    Submission,
    WorkerHeartbeat,
    utcnow,
)

TOKEN_PREFIX = "pg_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, role: str) -> tuple[ApiToken, str]:
    """A new token; the plaintext is returned once and only its hash is stored."""
    plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(name=name, role=role, token_hash=hash_token(plaintext))
    session.add(token)
    session.flush()
    return token, plaintext


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_token(session: Session, token_id: int) -> ApiToken | None:
    """Revoke a token (its sessions end with it); None if there is no such token. Revoking a
    revoked token keeps its first revocation time."""
    token = session.get(ApiToken, token_id)
    if token is not None and token.revoked_at is None:
        token.revoked_at = utcnow()
    return token


def find_token(session: Session, plaintext: str) -> ApiToken | None:
    return session.scalar(
        select(ApiToken).where(
            ApiToken.token_hash == hash_token(plaintext), ApiToken.revoked_at.is_(None)
        )
    )


def add_submission(session: Session, submission: Submission, queues: Sequence[str]) -> list[Job]:
    session.add(submission)
    session.flush()
    return add_jobs(session, submission, queues)


def add_jobs(session: Session, submission: Submission, queues: Sequence[str]) -> list[Job]:
    jobs = [Job(submission_id=submission.id, queue=q, state="queued") for q in queues]
    session.add_all(jobs)
    session.flush()
    return jobs


def get_submission(session: Session, submission_id: int, owner_id: int | None) -> Submission | None:
    """owner_id None: any submission (maintainers); else only that submitter's."""
    query = (
        select(Submission)
        .where(Submission.id == submission_id)
        .options(selectinload(Submission.jobs))
    )
    if owner_id is not None:
        query = query.where(Submission.submitter_id == owner_id)
    return session.scalar(query)


@dataclass(frozen=True)
class SubmissionFilter:
    state: str | None = None
    scope: str | None = None
    verdict: str | None = None
    owner_id: int | None = None  # contributors: only their own
    submitter: str | None = None  # a token name (needs a join with api_tokens)


def submission_conditions(filters: SubmissionFilter) -> list[Any]:
    """WHERE clauses for a submissions filter, shared by the API list and the dashboard."""
    conditions: list[Any] = []
    if filters.state:
        conditions.append(Submission.state == filters.state)
    if filters.scope:
        conditions.append(Submission.scope == filters.scope)
    if filters.verdict:
        conditions.append(Submission.verdict == filters.verdict)
    if filters.submitter:
        conditions.append(ApiToken.name == filters.submitter)
    if filters.owner_id is not None:
        conditions.append(Submission.submitter_id == filters.owner_id)
    return conditions


def list_submissions(
    session: Session, filters: SubmissionFilter, offset: int, limit: int
) -> tuple[list[Submission], int]:
    conditions = submission_conditions(filters)
    if filters.submitter:
        conditions.append(ApiToken.id == Submission.submitter_id)
    total = session.scalar(select(func.count()).select_from(Submission).where(*conditions)) or 0
    rows = session.scalars(
        select(Submission)
        .where(*conditions)
        .order_by(Submission.id.desc())
        .offset(offset)
        .limit(limit)
        .options(selectinload(Submission.jobs))
    ).all()
    return list(rows), total


def lock_job(session: Session, job_id: int) -> Job | None:
    """The job row, locked until commit on PostgreSQL (SQLite serializes writers anyway), its
    attributes read again even if this session had loaded it before."""
    query = select(Job).where(Job.id == job_id).with_for_update()
    return session.scalar(query.execution_options(populate_existing=True))


def jobs_of(session: Session, submission_id: int) -> list[Job]:
    return list(
        session.scalars(select(Job).where(Job.submission_id == submission_id).order_by(Job.id))
    )


def lock_submission(session: Session, submission_id: int) -> Submission:
    submission = session.scalar(
        select(Submission).where(Submission.id == submission_id).with_for_update()
    )
    assert submission is not None
    return submission


def fingerprint_id(session: Session, data: dict[str, Any]) -> int:
    """The id of this environment fingerprint, stored once per distinct hash."""
    digest = str(data.get("fingerprint_hash") or hashlib.sha256(repr(data).encode()).hexdigest())
    existing = session.scalar(
        select(EnvironmentFingerprint.id).where(EnvironmentFingerprint.hash == digest)
    )
    if existing is not None:
        return existing
    row = EnvironmentFingerprint(hash=digest, data=data)
    session.add(row)
    session.flush()
    return row.id


def add_report(session: Session, report: Report, results: Sequence[CaseResult]) -> None:
    session.add(report)
    session.add_all(results)
    session.flush()


def latest_report(session: Session, submission_id: int) -> Report | None:
    return session.scalar(
        select(Report)
        .join(Job, Job.id == Report.job_id)
        .where(Job.submission_id == submission_id)
        .order_by(Report.id.desc())
        .limit(1)
    )


def reports_of(session: Session, job_ids: Sequence[int]) -> list[Report]:
    return list(session.scalars(select(Report).where(Report.job_id.in_(job_ids))))


def add_serving_result(session: Session, result: ServingResult) -> ServingResult:
    session.add(result)
    session.flush()
    return result


def serving_results_of(session: Session, submission_id: int) -> list[ServingResult]:
    query = (
        select(ServingResult)
        .where(ServingResult.submission_id == submission_id)
        .order_by(ServingResult.id)
    )
    return list(session.scalars(query))


def record_audit(
    session: Session, actor: str, action: str, subject: str, detail: dict[str, Any]
) -> None:
    session.add(AuditEvent(actor=actor, action=action, subject=subject, detail=detail))


def beat(session: Session, name: str, queues: list[str], hardware: str) -> None:
    row = session.get(WorkerHeartbeat, name)
    if row is None:
        session.add(WorkerHeartbeat(name=name, queues=queues, hardware=hardware))
    else:
        row.queues, row.hardware, row.last_seen = queues, hardware, utcnow()


def live_queues(session: Session, stale_after_s: float) -> set[str]:
    since = utcnow() - timedelta(seconds=stale_after_s)
    rows = session.scalars(select(WorkerHeartbeat).where(WorkerHeartbeat.last_seen >= since))
    return {queue for row in rows for queue in row.queues}


def live_workers(session: Session, stale_after_s: float) -> set[str]:
    since = utcnow() - timedelta(seconds=stale_after_s)
    return set(
        session.scalars(select(WorkerHeartbeat.name).where(WorkerHeartbeat.last_seen >= since))
    )


def jobs_in_state(
    session: Session,
    state: str,
    before: datetime | None = None,
    started_before: datetime | None = None,
) -> list[Job]:
    """The jobs in this state (sent to the broker before `before`, started before
    `started_before`), locked until commit (the sweeper changes what it selects): a job a
    worker claims meanwhile is waited for and then left out, not read as it was before the
    claim and overwritten after it."""
    query = select(Job).where(Job.state == state)
    if before is not None:
        query = query.where(Job.enqueued_at < before)
    if started_before is not None:
        query = query.where(Job.started_at < started_before)
    query = query.order_by(Job.id).with_for_update().execution_options(populate_existing=True)
    return list(session.scalars(query))
