"""All configuration, read once from PATHGATE_* environment variables (and .env)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PATHGATE_", env_file=".env", extra="ignore")

    # Where `pathgate validate` writes evidence.json and report.md when --out is not given.
    output_dir: Path = Path("pathgate-out")
    # A SQLite file by default; PostgreSQL in deployment (postgresql+psycopg://...).
    database_url: str = "sqlite:///pathgate.db"
    # An embedded broker (a SQLite file through kombu's SQLAlchemy transport) by default;
    # Redis in deployment (redis://host:6379/0).
    broker_url: str = "sqla+sqlite:///pathgate-broker.db"
    # Folder for per-job workspaces (git checkouts, child logs).
    work_dir: Path = Path("pathgate-work")

    # API limits
    max_body_bytes: int = 1024 * 1024
    rate_limit_per_minute: int = 120

    # Jobs
    job_timeout_s: float = 3600.0  # wall clock of one evaluation child
    job_max_attempts: int = 3  # a job that kills its worker this many times ends `failed`
    worker_heartbeat_s: float = 15.0
    worker_stale_after_s: float = 60.0  # no heartbeat for this long: the worker is gone
    requeue_after_s: float = 300.0  # a job still queued this long is enqueued again
    # Override the detected hardware of `pathgate worker` (e.g. "cpu" on a GPU host).
    worker_hardware: str | None = None


@lru_cache
def get_settings() -> Settings:
    return Settings()
