"""POST /v1/github/webhook: signature verification, delivery idempotency, what is acted on."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from harness.errors import Unauthorized
from harness.github.hooks import PULL_REQUEST_TASK
from harness.github.models import PullRequestEventRecord
from harness.github.webhooks import signature, verify_signature
from harness.store.db import session_scope
from harness.store.models import WebhookDelivery
from tests.github.conftest import (
    REPO,
    PullRequest,
    TaskRecorder,
    deliver,
    delivery_headers,
    set_env,
)

GITHUB_SECRET = "It's a Secret to Everybody"
GITHUB_PAYLOAD = b"Hello, World!"
GITHUB_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
PR = PullRequest(number=7, sha="a" * 40, clone_url="https://github.com/acme/kernels.git")


def _count(model: type) -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_githubs_documented_test_vector_verifies() -> None:
    # https://docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries
    assert signature(GITHUB_SECRET, GITHUB_PAYLOAD) == GITHUB_SIGNATURE
    verify_signature(GITHUB_SECRET, GITHUB_PAYLOAD, GITHUB_SIGNATURE)


@pytest.mark.parametrize("header", [None, "", GITHUB_SIGNATURE.replace("sha256=7", "sha256=8")])
def test_test_vector_with_a_wrong_or_missing_signature_is_refused(header: str | None) -> None:
    with pytest.raises(Unauthorized):
        verify_signature(GITHUB_SECRET, GITHUB_PAYLOAD, header)
    with pytest.raises(Unauthorized):
        verify_signature(GITHUB_SECRET, b"Hello, World?", GITHUB_SIGNATURE)


def test_a_changed_byte_or_a_missing_header_is_401_and_stores_nothing(
    client: TestClient, tasks: TaskRecorder
) -> None:
    body = json.dumps(PR.payload("opened")).encode()
    headers = delivery_headers(body, "pull_request")
    tampered = body.replace(b'"number": 7', b'"number": 8')
    response = client.post("/v1/github/webhook", content=tampered, headers=headers)
    assert response.status_code == 401
    assert "does not match" in response.json()["detail"]
    del headers["X-Hub-Signature-256"]
    response = client.post("/v1/github/webhook", content=body, headers=headers)
    assert response.status_code == 401
    assert "missing X-Hub-Signature-256" in response.json()["detail"]
    assert (_count(WebhookDelivery), tasks.sent) == (0, [])


def test_without_a_configured_secret_the_webhook_is_401_and_says_why(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_env(monkeypatch, github_webhook_secret="")
    response = deliver(client, "ping", {"zen": "Keep it logically awesome."})
    assert response.status_code == 401
    assert "PATHGATE_GITHUB_WEBHOOK_SECRET" in response.json()["detail"]


def test_ping_is_answered(client: TestClient, tasks: TaskRecorder) -> None:
    response = deliver(client, "ping", {"zen": "Design for failure.", "hook_id": 1})
    assert (response.status_code, response.json()["status"]) == (200, "pong")
    assert tasks.sent == []


@pytest.mark.parametrize(
    ("event", "payload"),
    [
        ("issues", {"action": "opened", "issue": {"number": 1}}),
        ("push", {"ref": "refs/heads/main"}),
        ("pull_request", PR.payload("closed")),
        ("pull_request", PR.payload("edited")),
        ("pull_request", PR.payload("labeled", label="bug")),
    ],
)
def test_other_events_get_2xx_and_nothing_is_done(
    client: TestClient, tasks: TaskRecorder, event: str, payload: dict
) -> None:
    response = deliver(client, event, payload)
    assert (response.status_code, response.json()["status"]) == (200, "ignored")
    assert tasks.sent == []
    assert _count(PullRequestEventRecord) == 0


@pytest.mark.parametrize("action", ["opened", "synchronize", "reopened"])
def test_a_pull_request_is_stored_and_its_task_sent_after_commit_once(
    client: TestClient, tasks: TaskRecorder, action: str
) -> None:
    response = deliver(client, "pull_request", PR.payload(action), delivery="d-1")
    assert (response.status_code, response.json()["status"]) == (202, "queued")
    with session_scope() as session:
        record = session.scalars(select(PullRequestEventRecord)).one()
        assert (record.repo, record.pr_number, record.head_sha) == (REPO, 7, PR.sha)
        assert record.data["clone_url"] == PR.clone_url and not record.data["is_fork"]
    assert tasks.sent == [(PULL_REQUEST_TASK, record.id)]

    again = deliver(client, "pull_request", PR.payload(action), delivery="d-1")
    assert (again.status_code, again.json()["status"]) == (200, "duplicate")
    assert len(tasks.sent) == 1
    assert (_count(WebhookDelivery), _count(PullRequestEventRecord)) == (1, 1)


def test_the_approval_label_is_acted_on(client: TestClient, tasks: TaskRecorder) -> None:
    payload = PR.payload("labeled", label="pathgate:approved")
    response = deliver(client, "pull_request", payload)
    assert response.status_code == 202
    assert [task for task, _ in tasks.sent] == [PULL_REQUEST_TASK]


def test_a_payload_that_is_not_a_pull_request_is_422(client: TestClient) -> None:
    response = deliver(client, "pull_request", {"action": "opened", "pull_request": {}})
    assert response.status_code == 422
    # a number past the database's integers was a 500 at the insert
    huge = PR.payload("opened")
    huge["pull_request"]["number"] = 2**31
    response = deliver(client, "pull_request", huge)
    assert response.status_code == 422 and "number" in response.text
    response = client.post(
        "/v1/github/webhook",
        content=b"not json",
        headers=delivery_headers(b"not json", "pull_request"),
    )
    assert response.status_code == 422


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"action": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
        (b'{"action": "\\ud800"}', "lone surrogate"),
        (b"[1]", "not a JSON object"),
    ],
    ids=["nested", "long-int", "surrogate", "a-list"],
)
def test_a_signed_body_pathgate_cannot_read_is_422_and_stores_nothing(
    client: TestClient, tasks: TaskRecorder, body: bytes, words: str
) -> None:
    headers = delivery_headers(body, "pull_request")
    response = client.post("/v1/github/webhook", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert words in response.json()["detail"]
    assert _count(WebhookDelivery) == 0 and tasks.sent == []
