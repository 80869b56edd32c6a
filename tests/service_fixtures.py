"""Shared fixtures for tests that touch the store, the API or the queue: the real PostgreSQL and
Redis on this machine (127.0.0.1:5432 database `test`, 127.0.0.1:6379), and SQLite files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from harness.config import get_settings
from harness.store.db import engine_for
from harness.store.migrate import upgrade

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_URL = f"{POSTGRES_SERVER}/test"
REDIS_URL = "redis://127.0.0.1:6379/15"


def reset_postgres() -> None:
    """An empty public schema: every test starts from migrations, on the real server."""
    engine_for.cache_clear()
    empty_schema(POSTGRES_URL)


def empty_schema(url: str) -> str:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return url


def ensure_database(name: str) -> str:
    """The URL of a database of its own on the local server, created if missing: for tests that
    must not share the `test` database's schema with a concurrent run."""
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        found = connection.execute(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
        ).scalar()
        if not found:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"{POSTGRES_SERVER}/{name}"


def schema_differences(url: str) -> list[object]:
    """What Alembic's autogenerate would still change: empty when the models match the
    migrations applied to this database."""
    import harness.github.models  # noqa: F401  (its tables belong to the metadata)
    from harness.store.models import Base

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return list(compare_metadata(MigrationContext.configure(connection), Base.metadata))
    finally:
        engine.dispose()


def drop_database(name: str) -> None:
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def use_database(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("PATHGATE_DATABASE_URL", url)
    get_settings.cache_clear()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    if request.param == "postgresql":
        reset_postgres()
        url = POSTGRES_URL
    else:
        url = f"sqlite:///{tmp_path / 'pathgate.db'}"
    use_database(monkeypatch, url)
    upgrade(url)
    yield url
    engine_for(url).dispose()
    engine_for.cache_clear()
    get_settings.cache_clear()
