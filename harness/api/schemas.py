"""Request and response bodies: separate from the ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class InTreeSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["in_tree"]


class GitSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["git"]
    url: str = Field(min_length=1, max_length=500, pattern=r"^(https://|http://|file://|git@)")
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
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


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
    created_at: datetime
    updated_at: datetime
    jobs: list[JobRead]


class SubmissionPage(BaseModel):
    items: list[SubmissionRead]
    total: int
    page: int
    per_page: int


class Problem(BaseModel):
    detail: str
    errors: list[dict[str, Any]] = []
