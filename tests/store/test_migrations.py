"""Migrations on the real PostgreSQL: up and down cleanly, and the models match them."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from harness.store.migrate import downgrade, upgrade
from tests.service_fixtures import POSTGRES_URL, reset_postgres, schema_differences

TABLES = {
    "api_tokens",
    "audit_events",
    "case_results",
    "environment_fingerprints",
    "jobs",
    "reports",
    "review_decisions",
    "serving_results",
    "submissions",
    "webhook_deliveries",
    "worker_heartbeats",
    "github_pull_request_events",
    "github_status_postings",
}


@pytest.fixture
def postgres() -> str:
    reset_postgres()
    return POSTGRES_URL


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_then_downgrade_then_upgrade(postgres: str) -> None:
    upgrade(postgres)
    assert _tables(postgres) == TABLES
    downgrade(postgres)
    assert _tables(postgres) == set()
    upgrade(postgres)
    assert _tables(postgres) == TABLES


def test_models_match_migrations(postgres: str) -> None:
    upgrade(postgres)
    assert schema_differences(postgres) == []
