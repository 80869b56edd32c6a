"""Tables of the GitHub integration, on the store's metadata (migration 0002_github)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from harness.store.models import Base, Submission, utcnow


class PullRequestEventRecord(Base):
    """A pull_request delivery worth acting on, kept until (and after) its task handled it.

    Only the fields the flow needs are stored (events.PullRequestEvent), not the whole payload."""

    __tablename__ = "github_pull_request_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    # one event per delivery: the delivery row's unique id is what makes redeliveries no-ops
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id"), unique=True)
    repo: Mapped[str] = mapped_column(String(200), index=True)  # base repository, owner/name
    pr_number: Mapped[int]
    action: Mapped[str] = mapped_column(String(30))
    head_sha: Mapped[str] = mapped_column(String(40))
    data: Mapped[dict[str, Any]]
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    processed_at: Mapped[datetime | None] = mapped_column(default=None)
    outcome: Mapped[str | None] = mapped_column(Text, default=None)


class StatusPosting(Base):
    """One commit status (and, with App auth, its check run) to post, and how posting went.

    `submission_id` is empty for statuses about no submission: an invalid manifest, or a fork's
    pull request waiting for a maintainer's approval. `pathgate github sync` re-posts rows whose
    `posted_at` is empty."""

    __tablename__ = "github_status_postings"

    id: Mapped[int] = mapped_column(primary_key=True)
    submission_id: Mapped[int | None] = mapped_column(ForeignKey("submissions.id"), index=True)
    repo: Mapped[str] = mapped_column(String(200))  # owner/name of the base repository
    sha: Mapped[str] = mapped_column(String(40), index=True)
    context: Mapped[str] = mapped_column(String(100))  # pathgate/<scope>
    state: Mapped[str] = mapped_column(String(10))  # pending | success | failure | error
    description: Mapped[str] = mapped_column(String(140))  # GitHub's limit
    target_url: Mapped[str | None] = mapped_column(String(500))
    # A check run goes with the status when both are set and pathgate is a GitHub App.
    check_conclusion: Mapped[str | None] = mapped_column(String(20), default=None)
    check_summary: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    posted_at: Mapped[datetime | None] = mapped_column(default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    attempts: Mapped[int] = mapped_column(default=0)

    submission: Mapped[Submission | None] = relationship(lazy="raise")
