"""The part of a `pull_request` webhook payload pathgate acts on, validated.

https://docs.github.com/en/webhooks/webhook-events-and-payloads#pull_request
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harness.errors import InvalidInput

# Actions that put new code (or a maintainer's approval) on a pull request; the rest are ignored.
ACTED_ON = ("opened", "synchronize", "reopened", "labeled")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Repo(_Model):
    full_name: str
    clone_url: str


class _Ref(_Model):
    sha: str
    repo: _Repo | None  # None when the fork was deleted


class _Label(_Model):
    name: str


class _PullRequest(_Model):
    number: int = Field(ge=1, le=2**31 - 1)  # stored in a 32-bit column
    author_association: str
    head: _Ref
    base: _Ref
    labels: list[_Label] = []


class _Installation(_Model):
    id: int


class _Payload(_Model):
    action: str
    pull_request: _PullRequest
    label: _Label | None = None
    installation: _Installation | None = None


class PullRequestEvent(_Model):
    """What the pull-request task needs; stored as JSON with the event."""

    action: str
    repo: str  # the base repository (statuses go there), owner/name
    number: int
    head_sha: str
    clone_url: str  # the head repository's: a fork's for a pull request from a fork
    is_fork: bool
    author_association: str
    labels: list[str]
    label: str | None  # the label just added (action `labeled`)


def parse_pull_request(payload: dict[str, Any]) -> PullRequestEvent | None:
    """The event, or None when the head repository is gone (nothing to check out)."""
    try:
        parsed = _Payload.model_validate(payload)
    except ValidationError as exc:
        details = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]]
        raise InvalidInput("not a pull_request payload", details) from None
    pull, head_repo = parsed.pull_request, parsed.pull_request.head.repo
    base_repo = pull.base.repo
    if head_repo is None or base_repo is None:
        return None
    return PullRequestEvent(
        action=parsed.action,
        repo=base_repo.full_name,
        number=pull.number,
        head_sha=pull.head.sha,
        clone_url=head_repo.clone_url,
        is_fork=head_repo.full_name != base_repo.full_name,
        author_association=pull.author_association,
        labels=[label.name for label in pull.labels],
        label=parsed.label.name if parsed.label else None,
    )
