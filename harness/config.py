"""All configuration, read once from PATHGATE_* environment variables (and .env)."""

from __future__ import annotations

import secrets
from functools import lru_cache
from pathlib import Path

from pydantic import Field
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
    # an attached `vllm bench serve` result with per-request lists (--save-detailed) is larger
    max_serving_result_bytes: int = 16 * 1024 * 1024
    rate_limit_per_minute: int = 120

    # Jobs
    job_timeout_s: float = 3600.0  # wall clock of one evaluation child
    job_max_attempts: int = 3  # a job that kills its worker this many times ends `failed`
    worker_heartbeat_s: float = 15.0
    worker_stale_after_s: float = 60.0  # no heartbeat for this long: the worker is gone
    requeue_after_s: float = 300.0  # a job still queued this long is enqueued again
    # Override the detected hardware of `pathgate worker` (e.g. "cpu" on a GPU host).
    worker_hardware: str | None = None
    # The git transports a submission's source may use: https, http, ssh (git@host:...), file.
    # ssh fetches with the worker's own keys and file from the worker's own disk: allow them
    # only where every contributor is trusted (JSON: PATHGATE_GIT_PROTOCOLS='["https","file"]').
    git_protocols: list[str] = ["https"]
    # A worker runs submitted code only where the OS gives its child network, PID and mount
    # namespaces (workers/runner.py); true runs it without them, for trusted submitters only.
    allow_unisolated: bool = False

    # Base URL of this service as users reach it (links in statuses and check runs).
    public_url: str = "http://127.0.0.1:8000"

    # GitHub (docs/github.md). Workers never need these: statuses are posted from the API side.
    github_webhook_secret: str | None = None
    github_token: str | None = None  # plain token auth
    github_app_id: int | None = None  # GitHub App auth (with the private key)
    github_private_key_path: Path | None = None
    github_api_url: str = "https://api.github.com"
    # Pull requests from forks of first-time contributors wait for a maintainer's approval
    # (the label below, or an approve on the dashboard) before any of their code runs.
    github_require_approval_for_forks: bool = True
    github_approval_label: str = "pathgate:approved"

    # Dashboard sessions: the secret signing the session cookie (set it in deployment; the
    # default is regenerated per process, so sessions end when the API restarts).
    session_secret: str = Field(default_factory=lambda: secrets.token_urlsafe(32))
    session_max_age_s: int = 8 * 3600


@lru_cache
def get_settings() -> Settings:
    return Settings()
