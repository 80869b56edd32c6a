"""SQLAlchemy 2.0 models. Results are append-only: a rerun is a new Job, never an overwrite."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, get_args

from sqlalchemy import (
    JSON,
    DateTime,
    Dialect,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SubmissionState = Literal[
    "queued",
    "running",
    "passed",
    "failed",
    "needs_review",
    "inconclusive",
    "error",
    "timed_out",
    "waiting_for_hardware",
]
SUBMISSION_STATES: tuple[str, ...] = get_args(SubmissionState)
FINISHED_STATES = ("passed", "failed", "needs_review", "inconclusive", "error", "timed_out")


def utcnow() -> datetime:
    return datetime.now(UTC)


class StorableText(TypeDecorator[str]):
    """Text any database stores: a NUL character, which PostgreSQL refuses in text, becomes
    U+FFFD. Logs and reasons carry what a candidate printed or raised, NULs included."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else value.replace("\x00", "\ufffd")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        list[Any]: JSON,
        datetime: DateTime(timezone=True),
    }


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(20))  # contributor | maintainer
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the token
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Submission(Base):
    __tablename__ = "submissions"

    id: Mapped[int] = mapped_column(primary_key=True)
    scope: Mapped[str] = mapped_column(String(64), index=True)
    manifest_text: Mapped[str] = mapped_column(StorableText)  # as submitted
    manifest: Mapped[dict[str, Any]]  # as validated
    source_kind: Mapped[str] = mapped_column(String(10))  # in_tree | git
    source_url: Mapped[str | None] = mapped_column(String(500))
    source_sha: Mapped[str | None] = mapped_column(String(40))
    submitter_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id"), index=True)
    state: Mapped[str] = mapped_column(String(24), index=True)
    verdict: Mapped[str | None] = mapped_column(String(16), index=True)
    verdict_reasons: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    jobs: Mapped[list[Job]] = relationship(
        back_populates="submission", lazy="raise", order_by="Job.id"
    )


class Job(Base):
    """One evaluation of a submission on one hardware target (a queue)."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id"), index=True)
    queue: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(24), index=True)
    reason: Mapped[str | None] = mapped_column(StorableText)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    verdict: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    log_tail: Mapped[str | None] = mapped_column(StorableText)

    submission: Mapped[Submission] = relationship(back_populates="jobs", lazy="raise")


class EnvironmentFingerprint(Base):
    __tablename__ = "environment_fingerprints"

    id: Mapped[int] = mapped_column(primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Report(Base):
    """The evidence of one finished job, and its Markdown rendering."""

    __tablename__ = "reports"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), unique=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environment_fingerprints.id"))
    verdict: Mapped[str] = mapped_column(String(16))
    evidence: Mapped[dict[str, Any]]
    markdown: Mapped[str] = mapped_column(StorableText)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ServingResult(Base):
    """Serving-engine evidence attached to a submission: a `vllm bench serve --save-result` file
    (or a `pathgate serving ab` result), kept with its provenance. Append-only, like reports."""

    __tablename__ = "serving_results"

    id: Mapped[int] = mapped_column(primary_key=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id"), index=True)
    kind: Mapped[str] = mapped_column(String(30))  # "vllm_bench_serve"
    source_name: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64))
    attached_by: Mapped[str] = mapped_column(String(100))  # the API token's name
    data: Mapped[dict[str, Any]]  # provenance and rows, as the importer made them
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CaseResult(Base):
    __tablename__ = "case_results"
    __table_args__ = (UniqueConstraint("job_id", "case_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    case_id: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(10))  # case | probe
    origin: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    reasons: Mapped[list[Any]] = mapped_column(default=list)
    correctness: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    performance: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # raw samples included


class ReviewDecision(Base):
    __tablename__ = "review_decisions"

    id: Mapped[int] = mapped_column(primary_key=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id"), index=True)
    reviewer_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id"))
    decision: Mapped[str] = mapped_column(String(20))  # approve | request_changes
    comment: Mapped[str] = mapped_column(StorableText, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(primary_key=True)
    delivery_id: Mapped[str] = mapped_column(String(100), unique=True)
    event: Mapped[str] = mapped_column(String(50))
    received_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEvent(Base):
    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(50), index=True)
    subject: Mapped[str] = mapped_column(String(100))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerHeartbeat(Base):
    """Live workers and the queues they consume: how a job learns no one serves its hardware."""

    __tablename__ = "worker_heartbeats"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    queues: Mapped[list[Any]]
    hardware: Mapped[str] = mapped_column(String(64))
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
