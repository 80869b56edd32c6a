"""Receiving a webhook delivery: verify its signature, record it once, hand it to a task.

The request only stores and enqueues (GitHub wants an answer within 10 s; this takes
milliseconds); the GitHub API calls happen in the task on the "github" queue after commit.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.orm import Session

from harness.config import Settings
from harness.errors import InvalidInput, Unauthorized
from harness.github import hooks
from harness.github.events import ACTED_ON, PullRequestEvent, parse_pull_request
from harness.json_input import UnreadableJson, load_json
from harness.store import github as store

SIGNATURE_PREFIX = "sha256="


class NotConfigured(Unauthorized):
    """No secret here, so no delivery can verify: a 401 that says why. (Not a 503: the API
    answers no 5xx for anything a client sends; tests/api/test_openapi_fuzz.py holds it to that.)"""


@dataclass(frozen=True)
class Answer:
    status: Literal["pong", "queued", "ignored", "duplicate"]
    detail: str
    http_status: int = 200


def signature(secret: str, body: bytes) -> str:
    """The X-Hub-Signature-256 value GitHub sends for this body."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return SIGNATURE_PREFIX + digest


def verify_signature(secret: str | None, body: bytes, header: str | None) -> None:
    """Raise unless `header` is the HMAC-SHA256 of the raw body under the configured secret."""
    if not secret:
        raise NotConfigured(
            "GitHub webhooks are not configured here: set PATHGATE_GITHUB_WEBHOOK_SECRET"
        )
    if not header:
        raise Unauthorized("missing X-Hub-Signature-256 header")
    # compare_digest: the time taken must not reveal how much of a forged signature matched
    if not hmac.compare_digest(signature(secret, body).encode(), header.strip().encode()):
        raise Unauthorized("X-Hub-Signature-256 does not match the body")


def receive(
    session: Session,
    settings: Settings,
    event: str | None,
    delivery_id: str | None,
    body: bytes,
) -> Answer:
    """Handle one verified delivery; the caller commits, which sends the task."""
    if not event or not delivery_id:
        raise InvalidInput("missing X-GitHub-Event or X-GitHub-Delivery header")
    payload = _json(body)
    delivery = store.record_delivery(session, delivery_id[:100], event[:50])
    if delivery is None:
        return Answer("duplicate", f"delivery {delivery_id} was received before")
    if event == "ping":
        return Answer("pong", "webhook reached pathgate")
    pull_request = _acted_on(event, payload, settings.github_approval_label)
    if pull_request is None:
        return Answer("ignored", f"nothing to do for {event} {payload.get('action', '')}".strip())
    record = store.add_pull_request_event(session, delivery, pull_request.model_dump())
    hooks.enqueue_after_commit(session, hooks.PULL_REQUEST_TASK, record.id)
    return Answer("queued", f"pull request #{pull_request.number} queued", 202)


def _json(body: bytes) -> dict[str, Any]:
    try:
        payload = load_json(body)
    except UnreadableJson as exc:
        raise InvalidInput(f"the body: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInput("the body is not a JSON object")
    return payload


def _acted_on(event: str, payload: dict[str, Any], approval_label: str) -> PullRequestEvent | None:
    if event != "pull_request" or payload.get("action") not in ACTED_ON:
        return None
    pull_request = parse_pull_request(payload)
    if pull_request is None:
        return None
    # A label is news only when it is the maintainers' approval of a waiting fork.
    if pull_request.action == "labeled" and pull_request.label != approval_label:
        return None
    return pull_request
