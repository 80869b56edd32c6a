"""GitHub tasks enqueued after commit, on the dedicated "github" queue.

Any process may enqueue (the API on a webhook, a GPU worker whose job finished a submission):
enqueuing is a broker message and needs no GitHub credentials. Only the process serving the API
consumes "github" and holds the credentials. A task is sent only once its transaction commits,
so it never looks for rows that are not there yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from harness.store import github as store
from harness.store.models import FINISHED_STATES, Submission

log = logging.getLogger(__name__)

GITHUB_QUEUE = "github"
PULL_REQUEST_TASK = "pathgate.github.pull_request"  # (pull-request event id)
VERDICT_TASK = "pathgate.github.verdict"  # (submission id)
_PENDING = "pending_github_tasks"
WAITING = "waiting_for_hardware"  # not final, but posted: a pull request must not look queued

Sender = Callable[[str, int], None]


def send_to_broker(task: str, arg: int) -> None:
    from workers.celery_app import app

    app.send_task(task, args=[arg], queue=GITHUB_QUEUE)


# Tests swap this for a recorder (and run the task functions themselves).
sender: Sender = send_to_broker


def enqueue_after_commit(session: Session, task: str, arg: int) -> None:
    session.info.setdefault(_PENDING, []).append((task, arg))


def note_state_change(session: Session, submission: Submission, previous: str | None) -> None:
    """Called by submissions.refresh_state: a pull request's submission that just reached a
    final state gets its verdict posted; one that starts or stops waiting for hardware gets a
    pending status that says so, so that the pull request never shows "queued" for a job no
    worker can take."""
    if submission.state == previous:
        return
    worth_saying = submission.state in FINISHED_STATES or WAITING in (submission.state, previous)
    if worth_saying and store.has_postings(session, submission.id):
        enqueue_after_commit(session, VERDICT_TASK, submission.id)


@event.listens_for(Session, "after_commit")
def _send_pending(session: Session) -> None:
    for task, arg in session.info.pop(_PENDING, []):
        try:
            sender(task, arg)
        except Exception:
            # The commit stands; `pathgate github sync` posts what a lost message would have.
            log.exception("could not enqueue %s(%s) on the %s queue", task, arg, GITHUB_QUEUE)


@event.listens_for(Session, "after_soft_rollback")
def _drop_pending(session: Session, previous: SessionTransaction) -> None:
    # A rolled-back savepoint (a duplicate delivery's insert) leaves the outer transaction's
    # tasks standing; only the outermost rollback discards them.
    if not previous.nested:
        session.info.pop(_PENDING, None)
