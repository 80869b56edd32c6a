"""Engines and sessions. The caller that opens a session owns its commit (request or task)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from harness.config import get_settings


@lru_cache
def engine_for(url: str) -> Engine:
    _cached_urls.add(url)
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            json_serializer=storable_json,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url, pool_size=20, max_overflow=20, pool_pre_ping=True, json_serializer=storable_json
    )


def storable_json(value: Any) -> str:
    """JSON every database accepts: a non-finite float (an infinite error, a NaN in an imported
    benchmark file) as the string "Infinity", "-Infinity" or "NaN", the evidence's own
    convention (it reads back as a float), where json.dumps would write a bare Infinity that
    PostgreSQL's json type refuses."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _sqlite_pragmas(connection, _record) -> None:  # type: ignore[no-untyped-def]
    # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _forget_inherited_connections() -> None:
    """In a forked child (a Celery pool process), drop the parent's pooled connections without
    closing them: they are the parent's sockets, possibly mid-transaction in its heartbeat
    thread, and sharing them corrupts both sides. The child opens its own."""
    for url in list(_cached_urls):
        engine_for(url).dispose(close=False)


_cached_urls: set[str] = set()
os.register_at_fork(after_in_child=_forget_inherited_connections)


def get_engine() -> Engine:
    return engine_for(get_settings().database_url)


@lru_cache
def _factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


def new_session() -> Session:
    return _factory(get_settings().database_url)()


@contextmanager
def session_scope(prepare: Callable[[Session], None] | None = None) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error. `prepare` sees the new session
    first (the API installs its enqueue-after-commit hook there)."""
    session = new_session()
    if prepare is not None:
        prepare(session)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
