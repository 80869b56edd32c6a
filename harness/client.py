"""The HTTP client of the service: `pathgate submit` and `pathgate serving import-vllm --attach`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from harness.json_input import UnreadableJson, load_json

# waiting_for_hardware is as far as a submission gets until a worker for its hardware appears
# harness.store.models.FINISHED_STATES, and waiting; spelled out so the client needs no store
SETTLED = {
    "passed",
    "failed",
    "needs_review",
    "inconclusive",
    "error",
    "timed_out",
    "waiting_for_hardware",
}
POLL_S = 2.0


class ServiceError(Exception):
    """The service could not be reached, refused the request, or did not answer as pathgate."""


def submit_and_wait(
    server: str,
    token: str,
    manifest: str,
    git_url: str | None,
    git_sha: str | None,
    wait: bool,
    timeout_s: float,
    say: Callable[[str], None],
) -> str:
    """Submit; return the verdict (PASS / FAIL / NEEDS_REVIEW / INCONCLUSIVE) or the final state
    when waiting, else "submitted"."""
    source = {"kind": "git", "url": git_url, "sha": git_sha} if git_url else {"kind": "in_tree"}
    with _client(server, token) as client:
        body = {"manifest": manifest, "source": source}
        created = _call(client, "POST", "/v1/submissions", ("id", "state"), json=body)
        submission_id = created["id"]
        say(f"submission {submission_id}: {created['state']}")
        if not wait:
            return "submitted"
        return _wait(client, submission_id, timeout_s, say)


def _wait(
    client: httpx.Client, submission_id: int, timeout_s: float, say: Callable[[str], None]
) -> str:
    deadline = time.monotonic() + timeout_s
    last_state = ""
    while time.monotonic() < deadline:
        path = f"/v1/submissions/{submission_id}"
        submission = _call(client, "GET", path, ("state", "verdict", "verdict_reasons"))
        if submission["state"] != last_state:
            last_state = submission["state"]
            say(f"submission {submission_id}: {last_state}")
            for reason in submission["verdict_reasons"]:
                say(f"  - {reason}")
        if last_state in SETTLED:
            return str(submission["verdict"] or last_state)
        time.sleep(POLL_S)
    raise ServiceError(f"no verdict after {timeout_s:.0f} s (state: {last_state})")


def attach_serving_result(
    server: str, token: str, submission_id: int, name: str, raw: bytes
) -> None:
    """POST a `vllm bench serve` result file as it is (its sha256 is the provenance)."""
    with _client(server, token) as client:
        path = f"/v1/submissions/{submission_id}/serving-results"
        headers = {"Content-Type": "application/json"}
        _call(
            client,
            "POST",
            path,
            ("id", "sha256"),
            params={"name": name},
            content=raw,
            headers=headers,
        )


def _client(server: str, token: str) -> httpx.Client:
    if not (token.isascii() and token.isprintable()):  # an HTTP header cannot carry it
        raise ServiceError("the token is not a pathgate token (those are printable ASCII)")
    try:
        return httpx.Client(
            base_url=server.rstrip("/"), headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
    except httpx.InvalidURL as exc:
        raise ServiceError(f"the server {server!r} is not a URL: {exc}") from None


def _call(
    client: httpx.Client, method: str, path: str, expect: tuple[str, ...], **request: Any
) -> dict:
    """The reply's JSON object; ServiceError when the server cannot be reached, refuses, or
    answers with something other than a pathgate reply holding the `expect` fields."""
    try:
        response = client.request(method, path, **request)
    except httpx.HTTPError as exc:
        raise ServiceError(f"cannot reach {client.base_url}: {exc}") from None
    if response.status_code >= 400:
        raise ServiceError(_describe(response))
    reply = _json_or_none(response)
    if not isinstance(reply, dict) or not all(key in reply for key in expect):
        raise ServiceError(
            f"{client.base_url} is not a pathgate service: {method} {path} answered "
            f"HTTP {response.status_code} with {response.text[:200]!r}"
        )
    return reply


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return load_json(response.content)
    except UnreadableJson:
        return None


def _describe(response: httpx.Response) -> str:
    body = _json_or_none(response)
    if not isinstance(body, dict) or "detail" not in body:  # not pathgate's error reply
        if response.text.lstrip()[:14].lower().startswith(("<!doctype html", "<html")):
            return (  # a web server's error page: dozens of lines of markup say nothing more
                f"HTTP {response.status_code} from {response.url}: a web page, not a pathgate "
                "service's reply (is --server the service's base URL?)"
            )
        return f"HTTP {response.status_code}: {response.text[:500]}"
    lines = [f"HTTP {response.status_code}: {body['detail']}"]
    errors = body.get("errors")
    for error in errors if isinstance(errors, list) else []:
        if isinstance(error, dict):
            loc = error.get("loc")
            where = ".".join(map(str, loc)) if isinstance(loc, list) else str(loc)
            lines.append(f"  {where}: {error.get('msg')}")
    return "\n".join(lines)
