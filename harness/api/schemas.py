"""Request and response bodies: separate from the ORM models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _as_utc(value: datetime) -> datetime:
    # Every timestamp is stored in UTC, but SQLite hands it back without its zone; a naive
    # datetime would be serialized without an offset, which is not an RFC 3339 date-time (the
    # OpenAPI `format` the responses declare). Found by tests/api/test_openapi_fuzz.py.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDateTime = Annotated[datetime, AfterValidator(_as_utc)]


class InTreeSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["in_tree"]


class GitSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["git"]
    # No control characters: a NUL byte in the URL reached PostgreSQL, which rejects it (a 500).
    url: str = Field(
        min_length=1, max_length=500, pattern=r"^(https://|http://|file://|git@)[^\x00-\x1f\x7f]*$"
    )
    sha: str = Field(pattern=r"^[0-9a-f]{40}$")


class SubmissionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    manifest: str | dict[str, Any] = Field(description="the scope manifest: YAML text or object")
    source: InTreeSource | GitSource = Field(discriminator="kind")


class ManifestCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    manifest: str | dict[str, Any]


class ManifestValid(BaseModel):
    valid: Literal[True] = True
    name: str
    queues: list[str]


class JobRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    queue: str
    state: str
    reason: str | None
    attempts: int
    worker: str | None
    verdict: str | None
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None


class ServingResultRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    submission_id: int
    kind: str
    source_name: str
    sha256: str
    attached_by: str
    created_at: UtcDateTime
    data: dict[str, Any]


class SubmissionCreated(BaseModel):
    id: int
    state: str


class SubmissionRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    scope: str
    state: str
    verdict: str | None
    verdict_reasons: list[str]
    source_kind: str
    source_url: str | None
    source_sha: str | None
    created_at: UtcDateTime
    updated_at: UtcDateTime
    jobs: list[JobRead]


class SubmissionPage(BaseModel):
    items: list[SubmissionRead]
    total: int
    page: int
    per_page: int


class Problem(BaseModel):
    detail: str
    errors: list[dict[str, Any]] = []


_PROBLEMS = {
    401: "no token, or an unknown or revoked one",
    403: "this needs a maintainer token",
    404: "no such submission (or not yours)",
    413: "request body over the size limit",
    415: "the body is not sent as JSON (Content-Type must be application/json)",
    422: "invalid request: one entry in `errors` per problem, with its location",
    429: "rate limit reached; see Retry-After",
}


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses. Every error body is a Problem (app.py's handlers);
    without these, FastAPI declares its own 422 shape (`detail` a list), which ours do not have."""
    return {code: {"model": Problem, "description": _PROBLEMS[code]} for code in codes}
