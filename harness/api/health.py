"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from sqlalchemy import text

from harness.config import get_settings
from harness.store.db import get_engine

router = APIRouter()

REQUESTS = Counter("pathgate_http_requests_total", "HTTP requests", ["method", "route", "status"])
LATENCY = Histogram("pathgate_http_request_seconds", "HTTP request latency", ["method", "route"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz() -> JSONResponse:
    checks = {"database": _database_ok(), "broker": _broker_ok()}
    status = 200 if all(v == "ok" for v in checks.values()) else 503
    return JSONResponse(checks, status_code=status)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _database_ok() -> str:
    try:
        with get_engine().connect() as connection:
            connection.execute(text("SELECT 1"))
        return "ok"
    except Exception as exc:
        return f"unreachable: {type(exc).__name__}"


def _broker_ok() -> str:
    try:
        with Connection(get_settings().broker_url, connect_timeout=2) as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
        return "ok"
    except Exception as exc:
        return f"unreachable: {type(exc).__name__}"
