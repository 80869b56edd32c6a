"""The dashboard's queries: list rows with their submitter, reports with their submission, runs of
a scope, and the review trail. Functions take a Session and never commit."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from harness.store import repositories as repo
from harness.store.models import (
    ApiToken,
    AuditEvent,
    Job,
    Report,
    ReviewDecision,
    Submission,
)

# The list's filter is the API's: one set of conditions for both.
ListFilter = repo.SubmissionFilter


@dataclass(frozen=True)
class SubmissionRow:
    id: int
    scope: str
    state: str
    verdict: str | None
    reasons: list[Any]
    submitter: str
    source_kind: str
    source_sha: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class RunRow:
    """One stored report of a scope: something to compare against."""

    report_id: int
    submission_id: int
    job_id: int
    queue: str
    verdict: str
    created_at: datetime


@dataclass(frozen=True)
class ReviewRow:
    reviewer: str
    decision: str
    comment: str
    created_at: datetime


def active_token(session: Session, token_id: int) -> ApiToken | None:
    token = session.get(ApiToken, token_id)
    return token if token is not None and token.revoked_at is None else None


def list_page(
    session: Session, filters: ListFilter, offset: int, limit: int
) -> tuple[list[SubmissionRow], int]:
    """One page of submissions, newest first, and how many match in all. Only the columns the
    list shows are read (no jobs, no manifests): this is the page that must stay fast."""
    conditions = repo.submission_conditions(filters)
    total = session.scalar(_joined(select(func.count()), filters).where(*conditions)) or 0
    query = select(
        Submission.id,
        Submission.scope,
        Submission.state,
        Submission.verdict,
        Submission.verdict_reasons,
        ApiToken.name,
        Submission.source_kind,
        Submission.source_sha,
        Submission.created_at,
        Submission.updated_at,
    ).join(ApiToken, ApiToken.id == Submission.submitter_id)
    query = query.where(*conditions).order_by(Submission.id.desc()).offset(offset).limit(limit)
    return [SubmissionRow(*row) for row in session.execute(query)], total


def _joined(query: Select[Any], filters: ListFilter) -> Select[Any]:
    query = query.select_from(Submission)
    if filters.submitter:
        query = query.join(ApiToken, ApiToken.id == Submission.submitter_id)
    return query


def scopes(session: Session, owner_id: int | None) -> list[str]:
    query = select(Submission.scope).distinct().order_by(Submission.scope)
    if owner_id is not None:
        query = query.where(Submission.submitter_id == owner_id)
    return list(session.scalars(query))


def submitters(session: Session) -> list[str]:
    """Names of tokens that have submitted something (for the maintainers' filter)."""
    query = (
        select(ApiToken.name)
        .where(ApiToken.id.in_(select(Submission.submitter_id).distinct()))
        .distinct()
        .order_by(ApiToken.name)
    )
    return list(session.scalars(query))


def submitter_name(session: Session, submission: Submission) -> str:
    return (
        session.scalar(select(ApiToken.name).where(ApiToken.id == submission.submitter_id)) or "?"
    )


def reports_by_job(session: Session, job_ids: list[int]) -> dict[int, Report]:
    rows = session.scalars(select(Report).where(Report.job_id.in_(job_ids)))
    return {report.job_id: report for report in rows}


def report_with_submission(
    session: Session, report_id: int, owner_id: int | None
) -> tuple[Report, Job, Submission] | None:
    """A report with its job and submission; None when absent or not the owner's."""
    query = (
        select(Report, Job, Submission)
        .join(Job, Job.id == Report.job_id)
        .join(Submission, Submission.id == Job.submission_id)
        .where(Report.id == report_id)
    )
    if owner_id is not None:
        query = query.where(Submission.submitter_id == owner_id)
    row = session.execute(query).first()
    return None if row is None else (row[0], row[1], row[2])


def runs_of_scope(
    session: Session, scope: str, owner_id: int | None, limit: int = 50
) -> list[RunRow]:
    query = (
        select(Report.id, Submission.id, Job.id, Job.queue, Report.verdict, Report.created_at)
        .join(Job, Job.id == Report.job_id)
        .join(Submission, Submission.id == Job.submission_id)
        .where(Submission.scope == scope)
        .order_by(Report.id.desc())
        .limit(limit)
    )
    if owner_id is not None:
        query = query.where(Submission.submitter_id == owner_id)
    return [RunRow(*row) for row in session.execute(query)]


def add_review(
    session: Session, submission_id: int, reviewer_id: int, decision: str, comment: str
) -> ReviewDecision:
    review = ReviewDecision(
        submission_id=submission_id, reviewer_id=reviewer_id, decision=decision, comment=comment
    )
    session.add(review)
    session.flush()
    return review


def reviews_of(session: Session, submission_id: int) -> list[ReviewRow]:
    query = (
        select(ApiToken.name, ReviewDecision.decision, ReviewDecision.comment)
        .add_columns(ReviewDecision.created_at)
        .join(ApiToken, ApiToken.id == ReviewDecision.reviewer_id)
        .where(ReviewDecision.submission_id == submission_id)
        .order_by(ReviewDecision.id.desc())
    )
    return [ReviewRow(*row) for row in session.execute(query)]


def audit_of(session: Session, subject: str, limit: int = 100) -> list[AuditEvent]:
    query = (
        select(AuditEvent)
        .where(AuditEvent.subject == subject)
        .order_by(AuditEvent.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))
