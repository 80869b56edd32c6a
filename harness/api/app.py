"""The FastAPI application: routes under /v1, one error handler, limits, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from harness import __version__
from harness.api import dashboard, github, health, submissions
from harness.api.limits import BodySizeLimit, RateLimiter, TooManyRequests
from harness.config import get_settings
from harness.errors import PathgateError

log = logging.getLogger(__name__)
Enqueue = Callable[[int, str], None]


def create_app(enqueue: Enqueue | None = None) -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        title="pathgate",
        version=__version__,
        description="Validation gate for specialized inference paths.",
    )
    app.state.enqueue = enqueue or _celery_enqueue
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_minute)
    app.include_router(health.router)
    app.include_router(submissions.router)
    app.include_router(github.router)
    app.include_router(dashboard.router)
    app.add_exception_handler(PathgateError, _pathgate_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(ObserveRequests)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        larger={submissions.SERVING_RESULTS_PATH: settings.max_serving_result_bytes},
    )
    return app


def _celery_enqueue(job_id: int, queue: str) -> None:
    from workers.celery_app import enqueue

    enqueue(job_id, queue)


async def _pathgate_error(request: Request, exc: PathgateError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooManyRequests) else None
    body = {"detail": exc.message, "errors": exc.details}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if request.url.path.startswith(dashboard.PREFIX):  # a person's browser, not an API client
        return dashboard.invalid_request_page(request, exc.errors())
    errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and "json" not in media_type and ["body"] in (e["loc"] for e in errors):
        # FastAPI reads only a JSON body as one: any other kind arrives as no object at all
        detail = f"the body must be JSON (Content-Type: application/json), not {media_type}"
        return JSONResponse({"detail": detail, "errors": errors}, status_code=415)
    return JSONResponse({"detail": "invalid request", "errors": errors}, status_code=422)


# What FastAPI answers (a 400) when its own json.loads of a body raises something other than a
# decode error: a RecursionError (nesting) or a ValueError (an integer of 4300+ digits).
FASTAPI_BODY_ERROR = "There was an error parsing the body"


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
        error = {
            "loc": ["body"],
            "msg": "not JSON pathgate can read: nested too deeply, or an integer of 4300+ digits",
            "type": "json_invalid",
        }
        return JSONResponse({"detail": "invalid request", "errors": [error]}, status_code=422)
    return await http_exception_handler(request, exc)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"detail": "internal error; it has been logged"}, status_code=500)


class ObserveRequests:
    """Request count and latency per route, as plain ASGI middleware. It replaced an
    `@app.middleware("http")` function (Starlette's BaseHTTPMiddleware), whose per-request task
    group and body streams cost 0.1-0.5 ms of CPU on every request (5-15% of a GET, measured
    for benchmarks/api_load.py). A request that raises is now counted too, as a 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            health.REQUESTS.labels(scope["method"], route, status).inc()
            health.LATENCY.labels(scope["method"], route).observe(time.perf_counter() - started)
