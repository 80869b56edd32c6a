"""Property-based fuzzing of the REST API from its own OpenAPI spec (schemathesis 4, in-process).

What it checks: every operation in the app's OpenAPI spec is called with generated requests
(valid and invalid bodies, queries and path ids) through the ASGI app, authenticated as a
maintainer, on a freshly migrated database: a SQLite file under tmp_path, and a PostgreSQL
database of this test process's own (`pathgate_schemathesis_<pid>`, dropped at the end; never
`test`). No response may be a 5xx, and a response whose status code the spec declares must
match the declared schema. One submission is stored first, so generated ids also reach the
found paths (reports, rerun); a second test gives generated submissions a valid manifest, so
their other fields travel all the way into the database. The inputs fuzzing found 500s with are
kept as explicit cases (a derandomized run need not draw them again), and so is the commit
ordering the load benchmark (benchmarks/api_load.py) found wrong.

Bounded for CI (about 40 s on 2 cores): 50 derandomized examples per operation, no example
database. Run:

    .venv/bin/pytest tests/api/test_openapi_fuzz.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlalchemy.orm import Session

from harness.api.app import create_app
from harness.config import get_settings
from harness.store import repositories as repo
from harness.store.db import engine_for, session_scope
from harness.store.migrate import upgrade
from tests.service_fixtures import drop_database, empty_schema, ensure_database

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
RMSNORM = (SCOPES / "fused-add-rmsnorm-h200.yaml").read_text()
SHA = "0123456789abcdef0123456789abcdef01234567"
FUZZ_DATABASE = "pathgate_schemathesis"
MAX_EXAMPLES = 50
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,  # the same examples on every run: stable in CI
    database=None,  # no .hypothesis/ directory
    deadline=None,  # the first request of a run pays for imports and connections
    suppress_health_check=list(HealthCheck),  # the fixtures are shared across examples on purpose
)


class Recorder:
    """Stands in for the broker: records (job id, queue) instead of enqueuing."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, job_id: int, queue: str) -> None:
        self.sent.append((job_id, queue))


@pytest.fixture(scope="session")
def fuzz_postgres() -> Iterator[str]:
    """This process's own database, so that two runs of this file at once (a developer and the
    whole suite, or xdist) never reset each other's schema; dropped at the end."""
    name = f"{FUZZ_DATABASE}_{os.getpid()}"
    yield ensure_database(name)
    engine_for.cache_clear()
    drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def fuzz_database(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    if request.param == "postgresql":
        url = empty_schema(request.getfixturevalue("fuzz_postgres"))
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
    """The app, with submission 1 stored (and its jobs), so id 1 reaches the found paths."""
    app = create_app(enqueue=Recorder())
    with TestClient(app) as client:
        response = client.post(
            "/v1/submissions",
            json={"manifest": RMSNORM, "source": {"kind": "in_tree"}},
            headers=auth_headers,
        )
        assert response.status_code == 201, response.text
    return app


def _call_and_check(case: schemathesis.Case, app: FastAPI, headers: dict[str, str]) -> None:
    case.call_and_validate(
        app=app,
        headers=headers,
        checks=[schemathesis.checks.not_a_server_error, response_schema_conformance],
    )


# The spec does not depend on the database, so it is loaded once, at collection; schemathesis
# then makes one test per operation (and pytest one per database).
# (`schemathesis.pytest.from_fixture` would load it per test, but fails under pytest 9: it sets
# the removed `Function._nodeid`.)
schema = schemathesis.openapi.from_dict(create_app(enqueue=Recorder()).openapi())


@schema.parametrize()
@FUZZ_SETTINGS
def test_api_never_5xx_and_matches_its_schema(
    case: schemathesis.Case, fuzz_app: FastAPI, auth_headers: dict[str, str]
) -> None:
    _call_and_check(case, fuzz_app, auth_headers)


def _with_valid_manifest(case: schemathesis.Case) -> schemathesis.Case:
    """A generated manifest never validates, so nothing would be stored: give the generated body
    a valid one, so that its other fields (the source) travel all the way into the database."""
    if isinstance(case.body, dict):
        case.body = {**case.body, "manifest": RMSNORM}
    return case


SUBMIT = schema["/v1/submissions"]["POST"]
STORED_CASES = st.one_of(
    SUBMIT.as_strategy(GenerationMode.POSITIVE).map(_with_valid_manifest),
    SUBMIT.as_strategy(GenerationMode.NEGATIVE).map(_with_valid_manifest),
)


@given(case=STORED_CASES)
@FUZZ_SETTINGS
def test_stored_submissions_never_5xx(
    case: schemathesis.Case, fuzz_app: FastAPI, auth_headers: dict[str, str]
) -> None:
    _call_and_check(case, fuzz_app, auth_headers)


# Inputs that were answered with a 500 before harness/api and harness/submissions.py were fixed:
# an id past the 32-bit id column (both databases), a NUL byte bound for a PostgreSQL text
# column, and YAML nested past Python's recursion limit.
FOUND: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/submissions/2147483648", None),
    ("GET", "/v1/submissions/9223372036854775808/report.json", None),
    ("POST", "/v1/submissions/18446744073709551616/rerun", None),
    ("GET", "/v1/submissions?scope=a%00b", None),
    (
        "POST",
        "/v1/submissions",
        {"manifest": RMSNORM, "source": {"kind": "git", "url": "https://h/r\x00", "sha": SHA}},
    ),
    ("POST", "/v1/scopes/validate", {"manifest": "[" * 20_000}),
    ("POST", "/v1/submissions", {"manifest": "[" * 20_000, "source": {"kind": "in_tree"}}),
]


def test_inputs_fuzzing_found_are_422(fuzz_app: FastAPI, auth_headers: dict[str, str]) -> None:
    with TestClient(fuzz_app, raise_server_exceptions=False) as client:
        answers = [
            (method, path[:60], client.request(method, path, json=body, headers=auth_headers))
            for method, path, body in FOUND
        ]
    assert [(m, p, r.status_code) for m, p, r in answers if r.status_code != 422] == []


def test_a_failed_commit_is_never_answered_201(
    fuzz_app: FastAPI, auth_headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's session commits before the response is sent (found by benchmarks/
    api_load.py: a POST's 201 went out before its commit, so its id could 404 on a read)."""

    def failing_commit(session: Session) -> None:
        raise RuntimeError("commit failed")

    body = {"manifest": RMSNORM, "source": {"kind": "in_tree"}}
    with TestClient(fuzz_app, raise_server_exceptions=False) as client:
        monkeypatch.setattr(Session, "commit", failing_commit)
        response = client.post("/v1/submissions", json=body, headers=auth_headers)
        monkeypatch.undo()
        total = client.get("/v1/submissions", headers=auth_headers).json()["total"]
    assert response.status_code == 500
    assert total == 1  # only the submission fuzz_app stored
