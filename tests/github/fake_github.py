"""A stand-in for GitHub's REST API, run by uvicorn in a thread: only the endpoints pathgate
calls, checked the way GitHub documents them (paths, methods, auth headers, payload shapes).

It records every call, collects every deviation in `problems` (a test asserts there are none),
and can answer one request with a rate-limit response carrying `retry-after`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

INSTALLATION_ID = 4242
RAW_MEDIA_TYPE = "application/vnd.github.raw+json"
STATUS_STATES = {"error", "failure", "pending", "success"}
CONCLUSIONS = {"action_required", "cancelled", "failure", "neutral", "success", "skipped"}
CONCLUSIONS |= {"stale", "timed_out"}


@dataclass
class Call:
    method: str
    path: str
    authorization: str
    body: Any
    at: float  # time.monotonic()


@dataclass
class RateLimit:
    path_contains: str
    status: int
    headers: dict[str, str]


@dataclass
class FakeGitHub:
    """token: the plain token accepted; or app_id + public_key_pem for GitHub App auth."""

    token: str | None = None
    app_id: int | None = None
    public_key_pem: bytes | None = None
    pull_files: dict[tuple[str, int], list[tuple[str, str]]] = field(default_factory=dict)
    contents: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (repo, path, ref)
    calls: list[Call] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rate_limits: list[RateLimit] = field(default_factory=list)
    installation_tokens: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_pull_request(self, repo: str, number: int, sha: str, files: dict[str, str]) -> None:
        """files: path -> content at `sha` (content "" for a removed file)."""
        self.pull_files[(repo, number)] = [
            (path, "removed" if text == "" else "added") for path, text in files.items()
        ]
        for path, text in files.items():
            self.contents[(repo, path, sha)] = text

    def rate_limit_once(self, path_contains: str, status: int, headers: dict[str, str]) -> None:
        self.rate_limits.append(RateLimit(path_contains, status, headers))

    def posted(self, kind: str) -> list[Call]:
        """Successful-looking POSTs of one kind ("statuses" or "check-runs")."""
        return [c for c in self.calls if c.method == "POST" and f"/{kind}" in c.path]

    # auth ------------------------------------------------------------------------------------

    def check_installation_or_token(self, authorization: str) -> str | None:
        scheme, _, value = authorization.partition(" ")
        if self.app_id is not None:
            ok = scheme == "token" and value in self.installation_tokens
            return None if ok else f"expected an installation token, got {authorization!r}"
        ok = scheme in ("token", "Bearer") and value == self.token
        return None if ok else f"expected the configured token, got {authorization!r}"

    def check_jwt(self, authorization: str) -> str | None:
        scheme, _, value = authorization.partition(" ")
        if scheme != "Bearer" or self.public_key_pem is None:
            return f"expected 'Bearer <app JWT>', got {authorization!r}"
        try:
            claims = jwt.decode(value, self.public_key_pem, algorithms=["RS256"])
        except jwt.PyJWTError as exc:
            return f"bad app JWT: {exc}"
        if str(claims.get("iss")) != str(self.app_id):
            return f"JWT issuer {claims.get('iss')!r} is not app {self.app_id}"
        return None

    def new_installation_token(self) -> dict[str, str]:
        token = f"ghs_fake{len(self.installation_tokens)}"
        self.installation_tokens.append(token)
        expires = datetime.now(UTC) + timedelta(hours=1)
        return {"token": token, "expires_at": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _problem(fake: FakeGitHub, status: int, message: str) -> JSONResponse:
    fake.problems.append(message)
    return JSONResponse({"message": message}, status_code=status)


def _status_problems(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return ["status body is not an object"]
    problems = []
    if body.get("state") not in STATUS_STATES:
        problems.append(f"status state {body.get('state')!r}")
    if not isinstance(body.get("context"), str):
        problems.append("status context missing")
    description = body.get("description")
    if not isinstance(description, str) or len(description) > 140:
        problems.append(f"status description {description!r}")
    if "target_url" in body and not isinstance(body["target_url"], str):
        problems.append(f"status target_url {body['target_url']!r}")
    unknown = set(body) - {"state", "context", "description", "target_url"}
    return problems + ([f"status fields {sorted(unknown)}"] if unknown else [])


def _check_run_problems(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return ["check-run body is not an object"]
    problems = [f"check-run {key} missing" for key in ("name", "head_sha") if key not in body]
    if body.get("status") != "completed" or body.get("conclusion") not in CONCLUSIONS:
        problems.append(f"check-run {body.get('status')!r}/{body.get('conclusion')!r}")
    output = body.get("output")
    if not isinstance(output, dict) or not {"title", "summary"} <= set(output):
        problems.append(f"check-run output {output!r}")
    elif len(output["summary"]) > 65535:
        problems.append(f"check-run summary of {len(output['summary'])} characters")
    return problems


def create_app(fake: FakeGitHub) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        raw = await request.body()
        body = await request.json() if raw else None
        with fake.lock:
            fake.calls.append(
                Call(
                    request.method,
                    request.url.path,
                    request.headers.get("authorization", ""),
                    body,
                    time.monotonic(),
                )
            )
            limit = next((r for r in fake.rate_limits if r.path_contains in request.url.path), None)
            if limit is not None:
                fake.rate_limits.remove(limit)
        if limit is not None:
            message = {"message": "API rate limit exceeded"}
            return JSONResponse(message, status_code=limit.status, headers=limit.headers)
        response: Response = await call_next(request)
        return response

    @app.get("/repos/{owner}/{repo}/installation")
    def installation(owner: str, repo: str, request: Request) -> Response:
        if error := fake.check_jwt(request.headers.get("authorization", "")):
            return _problem(fake, 401, error)
        return JSONResponse({"id": INSTALLATION_ID, "app_id": fake.app_id})

    @app.post("/app/installations/{installation_id}/access_tokens")
    def access_token(installation_id: int, request: Request) -> Response:
        if error := fake.check_jwt(request.headers.get("authorization", "")):
            return _problem(fake, 401, error)
        if installation_id != INSTALLATION_ID:
            return _problem(fake, 404, f"no installation {installation_id}")
        return JSONResponse(fake.new_installation_token(), status_code=201)

    @app.get("/repos/{owner}/{repo}/pulls/{number}/files")
    def files(owner: str, repo: str, number: int, request: Request) -> Response:
        if error := fake.check_installation_or_token(request.headers.get("authorization", "")):
            return _problem(fake, 401, error)
        entries = fake.pull_files.get((f"{owner}/{repo}", number))
        if entries is None:
            return _problem(fake, 404, f"no pull request {owner}/{repo}#{number}")
        return JSONResponse([_diff_entry(owner, repo, path, status) for path, status in entries])

    @app.get("/repos/{owner}/{repo}/contents/{path:path}")
    def contents(owner: str, repo: str, path: str, request: Request) -> Response:
        if error := fake.check_installation_or_token(request.headers.get("authorization", "")):
            return _problem(fake, 401, error)
        if RAW_MEDIA_TYPE not in request.headers.get("accept", ""):
            return _problem(fake, 415, f"expected Accept: {RAW_MEDIA_TYPE}")
        ref = request.query_params.get("ref", "")
        text = fake.contents.get((f"{owner}/{repo}", path, ref))
        if text is None:
            return _problem(fake, 404, f"no {path} at {ref!r}")
        return PlainTextResponse(text, media_type=RAW_MEDIA_TYPE)

    @app.post("/repos/{owner}/{repo}/statuses/{sha}")
    async def status(owner: str, repo: str, sha: str, request: Request) -> Response:
        if error := fake.check_installation_or_token(request.headers.get("authorization", "")):
            return _problem(fake, 401, error)
        body = await request.json()
        if problems := _status_problems(body):
            return _problem(fake, 422, "; ".join(problems))
        return JSONResponse({"id": len(fake.calls), **body, "creator": None}, status_code=201)

    @app.post("/repos/{owner}/{repo}/check-runs")
    async def check_run(owner: str, repo: str, request: Request) -> Response:
        authorization = request.headers.get("authorization", "")
        if fake.app_id is None or fake.check_installation_or_token(authorization):
            return _problem(fake, 403, "check runs need a GitHub App installation token")
        body = await request.json()
        if problems := _check_run_problems(body):
            return _problem(fake, 422, "; ".join(problems))
        return JSONResponse({"id": len(fake.calls), **body}, status_code=201)

    return app


def _diff_entry(owner: str, repo: str, path: str, status: str) -> dict[str, Any]:
    base = f"https://github.com/{owner}/{repo}"
    return {
        "sha": "0" * 40,
        "filename": path,
        "status": status,
        "additions": 1,
        "deletions": 0,
        "changes": 1,
        "blob_url": f"{base}/blob/x/{path}",
        "raw_url": f"{base}/raw/x/{path}",
        "contents_url": f"https://api.github.com/repos/{owner}/{repo}/contents/{path}",
    }


class ServerThread:
    """Serves an ASGI app on a free local port in a thread, until stop()."""

    def __init__(self, app: FastAPI) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_fake(fake: FakeGitHub) -> ServerThread:
    return ServerThread(create_app(fake)).start()
