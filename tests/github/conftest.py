"""Fixtures for the GitHub integration: a SQLite store under tmp_path (the shared PostgreSQL
`test` database is reset by other tests; the concurrency test uses its own database), a fake
GitHub, signed webhook deliveries, and a recorder standing in for the "github" queue."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("githubkit")  # the `github` extra

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from fastapi.testclient import TestClient

from harness.api.app import create_app
from harness.config import get_settings
from harness.github import hooks
from harness.github.webhooks import signature
from tests.github.fake_github import FakeGitHub, start_fake
from tests.service_fixtures import database_url  # noqa: F401  (fixture)

SECRET = "webhook-secret-for-tests"
REPO = "acme/kernels"
PUBLIC_URL = "https://pathgate.example"


class TaskRecorder:
    """Stands in for the "github" queue: records (task, argument) sent after commit."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    def __call__(self, task: str, arg: int) -> None:
        self.sent.append((task, arg))

    def take(self, task: str) -> list[int]:
        args = [arg for name, arg in self.sent if name == task]
        self.sent = [(name, arg) for name, arg in self.sent if name != task]
        return args


class JobRecorder:
    """Stands in for the job queues: records (job id, queue)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, job_id: int, queue: str) -> None:
        self.sent.append((job_id, queue))


def set_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"PATHGATE_{name.upper()}", value)
    get_settings.cache_clear()


@pytest.fixture
def store(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:  # noqa: F811
    """The GitHub flows' store: service_fixtures' database (SQLite and the real PostgreSQL)
    with the webhook secret and the public URL set."""
    set_env(
        monkeypatch,
        github_webhook_secret=SECRET,
        public_url=PUBLIC_URL,
        work_dir=str(tmp_path / "work"),
    )
    return database_url


@pytest.fixture
def tasks(monkeypatch: pytest.MonkeyPatch) -> TaskRecorder:
    recorder = TaskRecorder()
    monkeypatch.setattr(hooks, "sender", recorder)
    return recorder


@pytest.fixture
def client(store: str, tasks: TaskRecorder) -> Iterator[TestClient]:
    with TestClient(create_app(enqueue=JobRecorder())) as test_client:
        yield test_client


@pytest.fixture
def fake_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGitHub]:
    fake = FakeGitHub(token="ghp_test_token")
    server = start_fake(fake)
    set_env(monkeypatch, github_api_url=server.url, github_token="ghp_test_token")
    monkeypatch.delenv("PATHGATE_GITHUB_APP_ID", raising=False)
    yield fake
    server.stop()


@pytest.fixture
def fake_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeGitHub]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_path = tmp_path / "app.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    fake = FakeGitHub(app_id=31337, public_key_pem=public)
    server = start_fake(fake)
    set_env(
        monkeypatch,
        github_api_url=server.url,
        github_app_id="31337",
        github_private_key_path=str(key_path),
    )
    monkeypatch.delenv("PATHGATE_GITHUB_TOKEN", raising=False)
    yield fake
    server.stop()


@dataclass(frozen=True)
class PullRequest:
    number: int
    sha: str
    clone_url: str
    fork: bool = False
    association: str = "MEMBER"
    labels: tuple[str, ...] = ()

    def payload(self, action: str, label: str | None = None) -> dict[str, Any]:
        head_repo = "someone/kernels" if self.fork else REPO
        payload: dict[str, Any] = {
            "action": action,
            "number": self.number,
            "pull_request": {
                "number": self.number,
                "author_association": self.association,
                "labels": [{"name": name} for name in self.labels],
                "head": {
                    "sha": self.sha,
                    "repo": {"full_name": head_repo, "clone_url": self.clone_url},
                },
                "base": {
                    "sha": "f" * 40,
                    "repo": {"full_name": REPO, "clone_url": f"https://github.com/{REPO}.git"},
                },
            },
            "repository": {"full_name": REPO},
        }
        if label is not None:
            payload["label"] = {"name": label}
        return payload


def delivery_headers(body: bytes, event: str, delivery: str | None = None) -> dict[str, str]:
    return {
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-Hub-Signature-256": signature(SECRET, body),
        "Content-Type": "application/json",
    }


def deliver(
    client: TestClient, event: str, payload: dict[str, Any], delivery: str | None = None
) -> Any:
    body = json.dumps(payload).encode()
    return client.post(
        "/v1/github/webhook", content=body, headers=delivery_headers(body, event, delivery)
    )


def git_repo(path: Path, files: dict[str, str]) -> tuple[str, str]:
    """A local git repository with these files committed: (file:// URL, commit SHA)."""
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "contribution"], check=True)
    sha = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return path.resolve().as_uri(), sha
