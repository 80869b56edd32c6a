"""The pull-request flow, run by the "github" task for one stored pull_request event.

For each `scopes/*.yaml` the pull request adds or modifies: read it at the head SHA, validate
it, and either
- post `failure` with the validation messages (an invalid manifest is answered, not ignored);
- post `pending` "waiting for a maintainer's approval" (a fork's pull request by a first-time
  contributor, until a maintainer adds the approval label: docs/github.md, "Forks");
- or submit it (source: the head repository's clone URL at the head SHA, submitter: the
  "github" token row) and post `pending` with a link to its report.
A manifest already submitted at this SHA is left alone, so a redelivered or relabeled event
submits nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml
from sqlalchemy.orm import Session

from harness.config import Settings, get_settings
from harness.errors import InvalidInput
from harness.github import statuses
from harness.github.client import GitHubClient
from harness.github.events import PullRequestEvent
from harness.github.models import StatusPosting
from harness.store import github as store
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.submissions import Enqueue, Source, install_enqueue_hook, parse_manifest, submit

# every status of a file present at the head: a manifest renamed or copied into scopes/ (with
# or without edits) is as new to the gate as an added one
MANIFEST_CHANGES = ("added", "modified", "renamed", "copied", "changed")
# author_association values of people who have not contributed to the repository before
FIRST_TIMERS = ("FIRST_TIME_CONTRIBUTOR", "FIRST_TIMER", "NONE")
WAITING = "waiting for a maintainer's approval (label {label})"


@dataclass(frozen=True)
class ManifestFile:
    path: str
    text: str


def process_event(event_id: int, client: GitHubClient, enqueue: Enqueue) -> list[int]:
    """Handle one stored event; the ids of the postings made. GitHub is read before the
    transaction and written after it, so no database lock waits on the network."""
    with session_scope() as session:
        record = store.get_pull_request_event(session, event_id)
        if record is None or record.processed_at is not None:
            return []
        event = PullRequestEvent.model_validate(record.data)
    manifests = changed_manifests(client, event)
    with session_scope() as session:
        install_enqueue_hook(session, enqueue)
        posting_ids = [_handle(session, event, m, get_settings()) for m in manifests]
        store.mark_event_processed(session, event_id, f"{len(manifests)} manifest(s)")
    made = [posting_id for posting_id in posting_ids if posting_id is not None]
    for posting_id in made:
        statuses.deliver(posting_id, client)
    return made


def changed_manifests(client: GitHubClient, event: PullRequestEvent) -> list[ManifestFile]:
    """The scopes/*.yaml the pull request adds, modifies, renames or copies, as of the head SHA
    (read from the base repository, which holds every pull request's commits, so an App
    installed there can read forks' too)."""
    files = client.changed_files(event.repo, event.number)
    paths = [f.path for f in files if f.status in MANIFEST_CHANGES and is_manifest(f.path)]
    return [ManifestFile(p, client.file_text(event.repo, p, event.head_sha)) for p in paths]


def is_manifest(path: str) -> bool:
    parts = PurePosixPath(path)
    return str(parts.parent) == "scopes" and parts.suffix == ".yaml"


def needs_approval(event: PullRequestEvent, settings: Settings) -> bool:
    return (
        settings.github_require_approval_for_forks
        and event.is_fork
        and event.author_association in FIRST_TIMERS
        and settings.github_approval_label not in event.labels
    )


def _handle(
    session: Session, event: PullRequestEvent, manifest: ManifestFile, settings: Settings
) -> int | None:
    try:
        scope = parse_manifest(manifest.text)[0].name
    except InvalidInput as exc:
        context = _invalid_context(manifest)
        if store.posted_for_commit(session, event.repo, event.head_sha, context, "failure"):
            return None  # answered already (this event was redelivered or relabeled)
        return _invalid(session, event, manifest, context, exc).id
    context = statuses.context_for(scope)
    if store.submission_for_commit(session, event.repo, event.head_sha, context) is not None:
        return None
    if needs_approval(event, settings):
        waiting = WAITING.format(label=settings.github_approval_label)
        return _post(session, event, context, "pending", waiting).id
    return _submit(session, event, manifest, context, settings).id


def _submit(
    session: Session,
    event: PullRequestEvent,
    manifest: ManifestFile,
    context: str,
    settings: Settings,
) -> StatusPosting:
    live = repo.live_queues(session, settings.worker_stale_after_s)
    source = Source(kind="git", url=event.clone_url, sha=event.head_sha)
    submission = submit(session, manifest.text, source, store.github_submitter(session), live)
    description = f"submission {submission.id}: {submission.state.replace('_', ' ')}"
    url = statuses.report_url(settings, submission.id)
    return _post(session, event, context, "pending", description, url, submission.id)


def _invalid(
    session: Session,
    event: PullRequestEvent,
    manifest: ManifestFile,
    context: str,
    exc: InvalidInput,
) -> StatusPosting:
    messages = [_message(detail) for detail in exc.details] or [exc.message]
    description = f"invalid {manifest.path}: " + "; ".join(messages)
    summary = f"`{manifest.path}` at `{event.head_sha}`:\n\n" + "\n".join(
        f"- {m}" for m in messages
    )
    posting = _post(session, event, context, "failure", description)
    posting.check_conclusion, posting.check_summary = "failure", summary
    return posting


def _message(detail: dict[str, Any]) -> str:
    loc = [str(part) for part in detail.get("loc", [])][2:]  # drop "body", "manifest"
    line = f" (line {detail['line']})" if detail.get("line") else ""
    return f"{'.'.join(loc) or 'manifest'}{line}: {detail.get('msg')}"


def _invalid_context(manifest: ManifestFile) -> str:
    """The manifest's `name` when it reads as one, so fixing the file updates the same check;
    else the file's stem."""
    try:
        data = yaml.safe_load(manifest.text)
    except (yaml.YAMLError, RecursionError):
        data = None
    name = data.get("name") if isinstance(data, dict) else None
    stem = PurePosixPath(manifest.path).stem[:64]
    scope = name if isinstance(name, str) and 0 < len(name) <= 64 else stem
    return statuses.context_for(scope)


def _post(
    session: Session,
    event: PullRequestEvent,
    context: str,
    state: str,
    description: str,
    target_url: str | None = None,
    submission_id: int | None = None,
) -> StatusPosting:
    posting = StatusPosting(
        submission_id=submission_id,
        repo=event.repo,
        sha=event.head_sha,
        context=context,
        state=state,
        description=statuses.truncate(description, statuses.DESCRIPTION_MAX),
        target_url=target_url,
    )
    return store.add_posting(session, posting)
