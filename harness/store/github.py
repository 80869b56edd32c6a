"""Every query of the GitHub integration. Functions take a Session and never commit."""

from __future__ import annotations

from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from harness.github.models import PullRequestEventRecord, StatusPosting
from harness.store import repositories as repo
from harness.store.models import FINISHED_STATES, ApiToken, Submission, WebhookDelivery, utcnow

GITHUB_TOKEN_NAME = "github"  # the submitter of every submission a pull request creates


def record_delivery(session: Session, delivery_id: str, event: str) -> WebhookDelivery | None:
    """The new delivery row, or None when this delivery id was recorded before.

    The unique constraint decides, not a prior SELECT: two concurrent copies of one delivery
    both pass a check, but only one insert can commit (the other waits, then fails)."""
    row = WebhookDelivery(delivery_id=delivery_id, event=event)
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        return None
    return row


def add_pull_request_event(
    session: Session, delivery: WebhookDelivery, data: dict[str, Any]
) -> PullRequestEventRecord:
    record = PullRequestEventRecord(
        delivery_id=delivery.id,
        repo=data["repo"],
        pr_number=data["number"],
        action=data["action"],
        head_sha=data["head_sha"],
        data=data,
    )
    session.add(record)
    session.flush()
    return record


def get_pull_request_event(session: Session, event_id: int) -> PullRequestEventRecord | None:
    return session.get(PullRequestEventRecord, event_id)


def mark_event_processed(session: Session, event_id: int, outcome: str) -> None:
    record = session.get(PullRequestEventRecord, event_id)
    if record is not None:
        record.processed_at, record.outcome = utcnow(), outcome[:2000]


def mark_event_failed(session: Session, event_id: int, error: str) -> None:
    """Why the event's task failed; it stays unprocessed, so a retry handles it."""
    record = session.get(PullRequestEventRecord, event_id)
    if record is not None:
        record.outcome = f"failed: {error}"[:2000]


def github_submitter(session: Session) -> ApiToken:
    """The token row that submits for pull requests, created (role contributor) if missing."""
    token = session.scalar(
        select(ApiToken)
        .where(ApiToken.name == GITHUB_TOKEN_NAME, ApiToken.revoked_at.is_(None))
        .order_by(ApiToken.id)
        .limit(1)
    )
    if token is None:
        # Nobody authenticates with it: the plaintext is dropped, only the row is needed.
        token, _ = repo.create_token(session, GITHUB_TOKEN_NAME, "contributor")
    return token


def add_posting(session: Session, posting: StatusPosting) -> StatusPosting:
    session.add(posting)
    session.flush()
    return posting


def get_posting(session: Session, posting_id: int) -> StatusPosting | None:
    return session.get(StatusPosting, posting_id)


def record_attempt(session: Session, posting_id: int, error: str | None) -> None:
    posting = session.get(StatusPosting, posting_id)
    if posting is None:
        return
    posting.attempts += 1
    posting.last_error = error
    posting.posted_at = utcnow() if error is None else None


def latest_posting(session: Session, submission_id: int) -> StatusPosting | None:
    """The submission's newest posting: where (repo, sha, context) its statuses go."""
    return session.scalar(
        select(StatusPosting)
        .where(StatusPosting.submission_id == submission_id)
        .order_by(StatusPosting.id.desc())
        .limit(1)
    )


def has_postings(session: Session, submission_id: int) -> bool:
    """Whether the submission came from a pull request (it got a pending status)."""
    query = select(exists().where(StatusPosting.submission_id == submission_id))
    return bool(session.scalar(query))


def submission_for_commit(session: Session, repo_name: str, sha: str, context: str) -> int | None:
    """The submission already made for this scope at this commit, if any."""
    return session.scalar(
        select(StatusPosting.submission_id)
        .where(
            StatusPosting.repo == repo_name,
            StatusPosting.sha == sha,
            StatusPosting.context == context,
            StatusPosting.submission_id.is_not(None),
        )
        .limit(1)
    )


def posted_for_commit(session: Session, repo_name: str, sha: str, context: str, state: str) -> bool:
    """Whether a status in this state was recorded for this context at this commit."""
    query = select(
        exists().where(
            StatusPosting.repo == repo_name,
            StatusPosting.sha == sha,
            StatusPosting.context == context,
            StatusPosting.state == state,
        )
    )
    return bool(session.scalar(query))


def unposted_postings(session: Session) -> list[int]:
    """Postings whose last attempt failed (or that were never attempted), oldest first."""
    query = select(StatusPosting.id).where(StatusPosting.posted_at.is_(None))
    return list(session.scalars(query.order_by(StatusPosting.id)))


def unreported_verdicts(session: Session) -> list[int]:
    """Finished submissions (and ones waiting for hardware) from pull requests whose newest
    posting is `pending`: their status task may never have run (the broker was down, say);
    statuses.record_verdict skips what was posted already."""
    newest = (
        select(func.max(StatusPosting.id))
        .where(StatusPosting.submission_id.is_not(None))
        .group_by(StatusPosting.submission_id)
    )
    query = (
        select(StatusPosting.submission_id)
        .join(Submission, Submission.id == StatusPosting.submission_id)
        .where(
            StatusPosting.id.in_(newest),
            StatusPosting.state == "pending",
            Submission.state.in_((*FINISHED_STATES, "waiting_for_hardware")),
        )
        .order_by(StatusPosting.submission_id)
    )
    return [sid for sid in session.scalars(query) if sid is not None]
