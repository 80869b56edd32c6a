"""One error base for the service: a status code, a message, optional details for the client."""

from __future__ import annotations

from typing import Any


class PathgateError(Exception):
    status_code = 400

    def __init__(self, message: str, details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []


class NotFound(PathgateError):
    status_code = 404


class Forbidden(PathgateError):
    status_code = 403


class Unauthorized(PathgateError):
    status_code = 401


class InvalidInput(PathgateError):
    status_code = 422


class Conflict(PathgateError):
    status_code = 409
