"""Property-based fuzzing of the REST API from its own OpenAPI spec (schemathesis 4, in-process).

Every operation in /openapi.json is called with generated requests (valid and invalid bodies,
queries and path ids) through the ASGI app, authenticated as a maintainer, on a freshly migrated
database: a SQLite file under tmp_path and a separate PostgreSQL database
(`pathgate_schemathesis`, never `public` of `test`). Each response must not be a 5xx and, where
the spec declares its status code, must match the declared schema. One submission is stored
first so that generated ids also reach the found paths (reports, rerun).

Bounded for CI: a few dozen derandomized examples per operation, no example database.

    .venv/bin/pytest tests/api/test_openapi_fuzz.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlalchemy import create_engine, text

from harness.api.app import create_app
from harness.config import get_settings
from harness.store import repositories as repo
from harness.store.db import engine_for, session_scope
from harness.store.migrate import upgrade

RMSNORM = (
    Path(__file__).resolve().parents[2] / "scopes" / "fused-add-rmsnorm-h200.yaml"
).read_text()
POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
FUZZ_DATABASE = "pathgate_schemathesis"
MAX_EXAMPLES = 50


class Recorder:
    """Stands in for the broker: records (job id, queue) instead of enqueuing."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, job_id: int, queue: str) -> None:
        self.sent.append((job_id, queue))


def _fresh_postgres_database() -> str:
    """The fuzz database, created if missing, with an empty public schema of its own."""
    admin = create_engine(f"{POSTGRES_SERVER}/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        exists = connection.scalar(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": FUZZ_DATABASE}
        )
        if not exists:
            connection.execute(text(f'CREATE DATABASE "{FUZZ_DATABASE}"'))
    admin.dispose()
    url = f"{POSTGRES_SERVER}/{FUZZ_DATABASE}"
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def fuzz_database(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    if request.param == "postgresql":
        url = _fresh_postgres_database()
    else:
        url = f"sqlite:///{tmp_path / 'pathgate.db'}"
    monkeypatch.setenv("PATHGATE_DATABASE_URL", url)
    # /readyz checks the broker: an embedded one under tmp_path is always reachable
    monkeypatch.setenv("PATHGATE_BROKER_URL", f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    monkeypatch.setenv("PATHGATE_RATE_LIMIT_PER_MINUTE", "1000000")
    get_settings.cache_clear()
    engine_for.cache_clear()
    upgrade(url)
    yield url
    engine_for(url).dispose()
    engine_for.cache_clear()
    get_settings.cache_clear()


@pytest.fixture
def auth_headers(fuzz_database: str) -> dict[str, str]:
    with session_scope() as session:
        _, plaintext = repo.create_token(session, "fuzz-maintainer", "maintainer")
    return {"Authorization": f"Bearer {plaintext}"}


@pytest.fixture
def fuzz_app(fuzz_database: str, auth_headers: dict[str, str]) -> FastAPI:
    app = create_app(enqueue=Recorder())
    with TestClient(app) as client:
        response = client.post(
            "/v1/submissions",
            json={"manifest": RMSNORM, "source": {"kind": "in_tree"}},
            headers=auth_headers,
        )
        assert response.status_code == 201, response.text
    return app


# The spec does not depend on the database: load it once, at collection (one test per operation).
schema = schemathesis.openapi.from_dict(create_app(enqueue=Recorder()).openapi())


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_never_5xx_and_matches_its_schema(
    case: schemathesis.Case, fuzz_app: FastAPI, auth_headers: dict[str, str]
) -> None:
    case.call_and_validate(
        app=fuzz_app,
        headers=auth_headers,
        checks=[schemathesis.checks.not_a_server_error, response_schema_conformance],
    )


def _with_valid_manifest(case: schemathesis.Case) -> schemathesis.Case:
    """Random manifests never validate, so nothing would be stored: give the generated body a
    valid one, so its other fields (the source) travel all the way to the database."""
    if isinstance(case.body, dict):
        case.body = {**case.body, "manifest": RMSNORM}
    return case


SUBMIT = schema["/v1/submissions"]["POST"]
STORED_CASES = st.one_of(
    SUBMIT.as_strategy(GenerationMode.POSITIVE).map(_with_valid_manifest),
    SUBMIT.as_strategy(GenerationMode.NEGATIVE).map(_with_valid_manifest),
)


@given(case=STORED_CASES)
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_stored_submissions_never_5xx(
    case: schemathesis.Case, fuzz_app: FastAPI, auth_headers: dict[str, str]
) -> None:
    case.call_and_validate(
        app=fuzz_app,
        headers=auth_headers,
        checks=[schemathesis.checks.not_a_server_error, response_schema_conformance],
    )
