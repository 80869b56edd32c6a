"""Request limits: body size (413) and a per-token rate (429 with Retry-After)."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from harness.errors import PathgateError


class TooManyRequests(PathgateError):
    status_code = 429

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"rate limit reached; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RateLimiter:
    """Sliding one-minute window per token, in this process's memory."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._hits: dict[int, deque[float]] = {}
        self._lock = threading.Lock()

    def check(self, token_id: int) -> None:
        now = time.monotonic()
        with self._lock:
            hits = self._hits.setdefault(token_id, deque())
            while hits and hits[0] <= now - 60:
                hits.popleft()
            if len(hits) >= self.per_minute:
                raise TooManyRequests(max(1, math.ceil(hits[0] + 60 - now)))
            hits.append(now)


class BodySizeLimit:
    """413 for a body over its route's limit (max_bytes, or the limit of the first pattern of
    `larger` that matches the whole path): by its Content-Length, or, for a body sent without
    one (chunked), by reading it here first. Counting it while a route reads it would be too
    late: FastAPI turns any error while it parses a body into a 400."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.larger = [(re.compile(pattern), limit) for pattern, limit in (larger or {}).items()]

    def limit_for(self, path: str) -> int:
        return next((n for pattern, n in self.larger if pattern.fullmatch(path)), self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the server holds the body to it
            if declared.isdigit() and int(declared) > limit:
                await _too_large(send, limit)
                return
            await self.app(scope, receive, send)
            return
        messages = await _read_body(receive, limit)
        if messages is None:
            await _too_large(send, limit)
            return
        pending = iter(messages)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)


async def _read_body(receive: Receive, max_bytes: int) -> list[Message] | None:
    """The request's messages up to its last body part (or a disconnect); None once the body
    passes max_bytes."""
    messages, received = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        received += len(message.get("body", b""))
        if received > max_bytes:
            return None
        if not message.get("more_body", False):
            return messages


async def _too_large(send: Send, max_bytes: int) -> None:
    body = f'{{"detail":"request body over {max_bytes} bytes"}}'.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
