"""Dashboard sessions: a signed cookie holding the signed-in token's id and a CSRF token.

The cookie is `base64url(json) "." hex(hmac-sha256(session_secret, json))`: the server keeps no
session table, and a client cannot forge or extend one (the issue time is signed in). It never
holds the API token itself, only its id; each request checks that the token is still not
revoked. A visitor who has not signed in gets an anonymous session too, so the sign-in form
carries a CSRF token like every other form.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass

from fastapi import Response

COOKIE_NAME = "pathgate_session"
COOKIE_PATH = "/dashboard"
# Binds the signature to this use of the secret: the same secret may sign other things later.
PURPOSE = b"pathgate.dashboard.session.v1\x00"


@dataclass(frozen=True)
class WebSession:
    token_id: int | None  # None: not signed in
    csrf: str
    issued_at: int  # unix seconds


def anonymous() -> WebSession:
    return WebSession(token_id=None, csrf=secrets.token_urlsafe(32), issued_at=int(time.time()))


def signed_in(token_id: int) -> WebSession:
    # A fresh CSRF token at sign-in: one planted before sign-in is worthless after it.
    return WebSession(token_id=token_id, csrf=secrets.token_urlsafe(32), issued_at=int(time.time()))


def encode(session: WebSession, secret: str) -> str:
    body = json.dumps(asdict(session), separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(body).decode().rstrip("=") + "." + _sign(body, secret)


def decode(value: str | None, secret: str, max_age_s: int) -> WebSession | None:
    """The session in a cookie value, or None when absent, tampered with, malformed or expired."""
    if not value or value.count(".") != 1:
        return None
    encoded, signature = value.split(".")
    try:
        body = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        return None
    if not hmac.compare_digest(_sign(body, secret), signature):
        return None
    try:
        data = json.loads(body)
        session = WebSession(
            int(data["token_id"]) if data["token_id"] is not None else None,
            str(data["csrf"]),
            int(data["issued_at"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    return session if time.time() - session.issued_at <= max_age_s else None


def _sign(body: bytes, secret: str) -> str:
    return hmac.new(secret.encode(), PURPOSE + body, hashlib.sha256).hexdigest()


def csrf_ok(session: WebSession | None, submitted: str | None) -> bool:
    if session is None or not submitted:
        return False
    return hmac.compare_digest(session.csrf.encode(), submitted.encode())


def set_cookie(
    response: Response, session: WebSession, secret: str, max_age_s: int, secure: bool
) -> None:
    response.set_cookie(
        COOKIE_NAME,
        encode(session, secret),
        max_age=max_age_s,
        path=COOKIE_PATH,
        httponly=True,
        samesite="lax",
        secure=secure,
    )


def clear_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE_NAME, path=COOKIE_PATH, httponly=True, samesite="lax")
