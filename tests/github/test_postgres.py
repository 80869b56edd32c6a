"""On PostgreSQL (a database of its own, `pathgate_github`, since other tests drop `test`'s
schema): one delivery sent 10 times at once creates its submissions once, and the 0002_github
migration upgrades, downgrades and matches the models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, inspect, select

from harness.api.app import create_app
from harness.config import get_settings
from harness.github.hooks import PULL_REQUEST_TASK
from harness.store.db import engine_for, session_scope
from harness.store.migrate import downgrade, upgrade
from harness.store.models import Submission, WebhookDelivery
from tests.github.conftest import (
    JobRecorder,
    TaskRecorder,
    delivery_headers,
    set_env,
)
from tests.github.fake_github import FakeGitHub, ServerThread
from tests.github.test_pull_requests import open_pull_request, run_github_tasks
from tests.service_fixtures import (
    POSTGRES_SERVER,
    empty_schema,
    ensure_database,
    schema_differences,
)

DATABASE = "pathgate_github"
URL = f"{POSTGRES_SERVER}/{DATABASE}"
GITHUB_TABLES = {"github_pull_request_events", "github_status_postings"}
COPIES = 10


def _reset_database() -> None:
    empty_schema(ensure_database(DATABASE))


@pytest.fixture
def postgres(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    engine_for.cache_clear()
    _reset_database()
    set_env(monkeypatch, database_url=URL, github_webhook_secret="webhook-secret-for-tests")
    set_env(monkeypatch, work_dir=str(tmp_path / "work"))
    yield URL
    engine_for(URL).dispose()
    engine_for.cache_clear()
    get_settings.cache_clear()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migration_upgrades_downgrades_and_matches_the_models(postgres: str) -> None:
    upgrade(postgres)
    assert _tables(postgres) >= GITHUB_TABLES
    downgrade(postgres, "0001")
    assert not GITHUB_TABLES & _tables(postgres)
    assert "webhook_deliveries" in _tables(postgres)
    upgrade(postgres)
    assert schema_differences(postgres) == []
    downgrade(postgres)
    assert _tables(postgres) <= {"alembic_version"}


def test_one_delivery_sent_ten_times_at_once_submits_once(
    postgres: str, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    upgrade(postgres)
    pr = open_pull_request(tmp_path, fake_token)
    body = httpx.Request("POST", "/", json=pr.payload("opened")).content
    headers = delivery_headers(body, "pull_request", delivery="one-delivery")
    api = ServerThread(create_app(enqueue=JobRecorder())).start()

    start = threading.Barrier(COPIES)
    answers: list[tuple[int, str]] = []

    def send() -> None:
        start.wait()
        response = httpx.post(f"{api.url}/v1/github/webhook", content=body, headers=headers)
        answers.append((response.status_code, response.json()["status"]))

    senders = [threading.Thread(target=send) for _ in range(COPIES)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    api.stop()

    assert sorted(answers) == [(200, "duplicate")] * (COPIES - 1) + [(202, "queued")]
    assert [task for task, _ in tasks.sent] == [PULL_REQUEST_TASK]
    run_github_tasks(tasks, JobRecorder())
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(WebhookDelivery)) == 1
        scopes = session.scalars(select(Submission.scope)).all()
    assert scopes == ["contrib-rmsnorm-cpu"]  # one valid manifest changed: one submission
