"""A small wrapper over githubkit: the five GitHub REST calls pathgate makes, one auth choice.

Auth: a GitHub App (app id + private key: githubkit signs an RS256 JWT and exchanges it for an
installation token, which it caches until a minute before it expires) or a plain token.
Retries: a rate-limit answer (403/429 with `retry-after`, or `x-ratelimit-remaining: 0` with
`x-ratelimit-reset`) is retried after the time GitHub names when that is short enough to wait
inside a task; a 5xx or a network error is retried with exponential backoff. Anything else
raises GitHubError, which callers record (`pathgate github sync` retries it later).

githubkit is the optional `github` extra: import this module only where GitHub is used.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from githubkit import AppAuthStrategy, GitHub, TokenAuthStrategy
from githubkit.cache import MemCacheStrategy
from githubkit.exception import GitHubException, RateLimitExceeded, RequestError, RequestFailed
from githubkit.retry import RetryOption
from githubkit.utils import UNSET
from githubkit_schemas.latest.models import DiffEntry

from harness.config import Settings

MAX_RETRIES = 3
MAX_INLINE_WAIT_S = 60.0  # a longer rate-limit wait is left to `pathgate github sync`
RAW_CONTENT = {"Accept": "application/vnd.github.raw+json"}
StatusState = Literal["error", "failure", "pending", "success"]
Conclusion = Literal["success", "failure", "neutral", "timed_out", "cancelled", "action_required"]


class GitHubError(Exception):
    """A GitHub call that failed after its retries (or could not be made)."""


@dataclass(frozen=True)
class ChangedFile:
    path: str
    status: str  # added | modified | removed | renamed | ...


@dataclass(frozen=True)
class CommitStatus:
    context: str
    state: StatusState
    description: str
    target_url: str | None


@dataclass(frozen=True)
class CheckRun:
    name: str
    conclusion: Conclusion
    title: str
    summary: str
    details_url: str | None


def retry_decision(exc: GitHubException, retry_count: int) -> RetryOption:
    if retry_count >= MAX_RETRIES:
        return RetryOption(False)
    if isinstance(exc, RateLimitExceeded):
        wait = exc.retry_after.total_seconds()
        # githubkit sleeps 60 s on a zero wait (a reset already passed): wait one second instead
        return RetryOption(wait <= MAX_INLINE_WAIT_S, timedelta(seconds=max(wait, 1.0)))
    if isinstance(exc, RequestError) or (
        isinstance(exc, RequestFailed) and exc.response.status_code >= 500
    ):
        return RetryOption(True, timedelta(seconds=2**retry_count))
    return RetryOption(False)


class GitHubClient:
    def __init__(self, settings: Settings) -> None:
        self.app_auth = settings.github_app_id is not None
        self._github = GitHub(
            _auth(settings),
            base_url=settings.github_api_url,
            user_agent="pathgate",
            auto_retry=retry_decision,
            http_cache=False,  # file contents at a SHA never change; statuses are writes
            cache_strategy=MemCacheStrategy(),  # this client's tokens only
            timeout=30.0,
        )
        self._installations: dict[str, GitHub[Any]] = {}
        self._lock = threading.Lock()

    def changed_files(self, repo: str, number: int) -> list[ChangedFile]:
        owner, name = _split(repo)
        github = self._for(repo)
        with _errors(f"listing the files of {repo}#{number}"):
            entries: Iterable[DiffEntry] = github.rest.paginate(
                github.rest.pulls.list_files,
                owner=owner,
                repo=name,
                pull_number=number,
                per_page=100,
            )
            return [ChangedFile(entry.filename, entry.status) for entry in entries]

    def file_text(self, repo: str, path: str, ref: str) -> str:
        owner, name = _split(repo)
        github = self._for(repo)
        with _errors(f"fetching {path} at {ref} from {repo}"):
            response = github.rest.repos.get_content(
                owner, name, path, ref=ref, headers=RAW_CONTENT
            )
            return response.content.decode("utf-8", errors="replace")

    def post_status(self, repo: str, sha: str, status: CommitStatus) -> None:
        owner, name = _split(repo)
        github = self._for(repo)
        with _errors(f"posting status {status.context} on {repo}@{sha[:12]}"):
            github.rest.repos.create_commit_status(
                owner,
                name,
                sha,
                state=status.state,
                context=status.context,
                description=status.description,
                target_url=status.target_url or UNSET,
            )

    def create_check_run(self, repo: str, sha: str, run: CheckRun) -> None:
        owner, name = _split(repo)
        github = self._for(repo)
        with _errors(f"creating check run {run.name} on {repo}@{sha[:12]}"):
            github.rest.checks.create(
                owner,
                name,
                name=run.name,
                head_sha=sha,
                status="completed",
                conclusion=run.conclusion,
                output={"title": run.title, "summary": run.summary},
                details_url=run.details_url or UNSET,
            )

    def _for(self, repo: str) -> GitHub[Any]:
        """With App auth, a client acting as the App's installation on this repository."""
        if not self.app_auth:
            return self._github
        with self._lock:
            if repo not in self._installations:
                owner, name = _split(repo)
                with _errors(f"finding the App's installation on {repo}"):
                    found = self._github.rest.apps.get_repo_installation(owner, name)
                auth = self._github.auth
                assert isinstance(auth, AppAuthStrategy)
                installation = auth.as_installation(int(found.json()["id"]))
                self._installations[repo] = self._github.with_auth(installation)
            return self._installations[repo]


def _auth(settings: Settings) -> AppAuthStrategy | TokenAuthStrategy:
    if settings.github_app_id is not None:
        if settings.github_private_key_path is None:
            raise GitHubError("PATHGATE_GITHUB_APP_ID needs PATHGATE_GITHUB_PRIVATE_KEY_PATH")
        key = settings.github_private_key_path.read_text()
        return AppAuthStrategy(str(settings.github_app_id), key)
    if settings.github_token:
        return TokenAuthStrategy(settings.github_token)
    raise GitHubError(
        "no GitHub credentials: set PATHGATE_GITHUB_TOKEN, or PATHGATE_GITHUB_APP_ID and "
        "PATHGATE_GITHUB_PRIVATE_KEY_PATH"
    )


def _split(repo: str) -> tuple[str, str]:
    owner, _, name = repo.partition("/")
    return owner, name


@contextmanager
def _errors(doing: str) -> Iterator[None]:
    try:
        yield
    except RequestFailed as exc:
        raise GitHubError(f"{doing}: HTTP {exc.response.status_code}: {_message(exc)}") from exc
    except GitHubException as exc:
        raise GitHubError(f"{doing}: {exc}") from exc


def _message(exc: RequestFailed) -> str:
    try:
        body = exc.response.json()
    except ValueError:
        return exc.response.text[:300]
    return str(body.get("message", "") if isinstance(body, dict) else body)[:300]


_clients: dict[tuple[Any, ...], GitHubClient] = {}
_clients_lock = threading.Lock()


def get_client(settings: Settings) -> GitHubClient:
    """One client per configuration per process, so installation tokens are reused until they
    near expiry instead of being minted for every status."""
    key = (
        settings.github_api_url,
        settings.github_token,
        settings.github_app_id,
        settings.github_private_key_path,
    )
    with _clients_lock:
        if key not in _clients:
            _clients[key] = GitHubClient(settings)
        return _clients[key]
