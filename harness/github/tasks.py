"""Celery tasks of the "github" queue. Only the process serving the API consumes this queue
(it holds the GitHub credentials); any process may enqueue (hooks.py)."""

from __future__ import annotations

import logging

from harness.config import get_settings
from harness.github.hooks import PULL_REQUEST_TASK, VERDICT_TASK
from harness.store import github as store
from harness.store.db import session_scope
from workers.celery_app import app, enqueue

log = logging.getLogger(__name__)


@app.task(name=PULL_REQUEST_TASK, max_retries=3)
def handle_pull_request(event_id: int) -> None:
    """Submit the pull request's changed manifests and post their pending statuses."""
    from harness.github.client import GitHubError, get_client
    from harness.github.pull_requests import process_event

    try:
        process_event(event_id, get_client(get_settings()), enqueue)
    except GitHubError as exc:
        # Reading the pull request failed (statuses failing are recorded, not raised): note
        # why on the event, and try again later; manifests submitted already are not redone.
        log.warning("pull-request event %s: %s", event_id, exc)
        with session_scope() as session:
            store.mark_event_failed(session, event_id, str(exc))
        raise handle_pull_request.retry(countdown=60, exc=exc) from None


@app.task(name=VERDICT_TASK)
def post_verdict(submission_id: int) -> None:
    """Post a finished pull-request submission's verdict; a failed post stays recorded for
    `pathgate github sync`."""
    from harness.github.client import GitHubError, get_client
    from harness.github.statuses import post_verdict as post

    try:
        error = post(submission_id, get_client(get_settings()))
    except GitHubError as exc:  # no credentials configured: nothing could be posted
        error = str(exc)
    if error:
        log.warning("verdict of submission %s not posted: %s", submission_id, error)
