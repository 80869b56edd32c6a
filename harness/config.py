"""All configuration, read once from PATHGATE_* environment variables (and .env)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PATHGATE_", env_file=".env", extra="ignore")

    # Where `pathgate validate` writes evidence.json and report.md when --out is not given.
    output_dir: Path = Path("pathgate-out")


@lru_cache
def get_settings() -> Settings:
    return Settings()
