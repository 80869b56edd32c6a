"""Request dependencies: a database session that commits at the end, and the caller's token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from harness.errors import Forbidden, Unauthorized
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import ApiToken
from harness.submissions import install_enqueue_hook


def get_session(request: Request) -> Iterator[Session]:
    """The request's unit of work: committed when the route returns, rolled back on error."""
    with session_scope(lambda s: install_enqueue_hook(s, request.app.state.enqueue)) as session:
        yield session


# scope="function": the session commits when the route returns, before the response is sent. With
# FastAPI's default ("request") it committed only after the response had gone out: a client got
# 201 and an id that a read could not find yet (404s under benchmarks/api_load.py), or never, if
# the commit then failed.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def current_token(request: Request, session: SessionDep) -> ApiToken:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value:
        raise Unauthorized("send an API token as 'Authorization: Bearer <token>'")
    token = repo.find_token(session, value.strip())
    if token is None:
        raise Unauthorized("unknown or revoked API token")
    request.app.state.rate_limiter.check(token.id)
    return token


CurrentToken = Annotated[ApiToken, Depends(current_token)]


def maintainer(token: CurrentToken) -> ApiToken:
    if token.role != "maintainer":
        raise Forbidden("this needs a maintainer token")
    return token


Maintainer = Annotated[ApiToken, Depends(maintainer)]


def owner_filter(token: ApiToken) -> int | None:
    """Contributors see only their own submissions; maintainers see all."""
    return None if token.role == "maintainer" else token.id
