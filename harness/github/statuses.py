"""Commit statuses and check runs: what a submission's state looks like on its pull request.

Every posting is recorded first (github_status_postings) and posted after commit, so a failed
post leaves a row that `pathgate github sync` posts again.

The mapping (docs/github.md): PASS -> success; FAIL -> failure; NEEDS_REVIEW and INCONCLUSIVE ->
failure (a result too good to pass unread, or a claim nobody verified, must not pass the gate; a
maintainer reads the report and decides; the check run says `action_required` for review); error and
timed_out -> error (pathgate's own trouble: a rerun may fix it). Check runs (GitHub App auth
only) carry the submission's Markdown report; their conclusion follows the same mapping, with
`timed_out` for timed_out, since check runs have no `error`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from harness.config import Settings, get_settings
from harness.github.client import (
    CheckRun,
    CommitStatus,
    Conclusion,
    GitHubClient,
    GitHubError,
    StatusState,
)
from harness.github.models import StatusPosting
from harness.reports.combined import combined_report, render_combined_markdown
from harness.store import github as store
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import Submission

DESCRIPTION_MAX = 140  # GitHub's limit for a status description
SUMMARY_MAX = 65535  # GitHub's limit for a check run's output.summary
STATUS_FOR_STATE = {
    "queued": "pending",  # posted only on the way out of waiting_for_hardware (hooks.py)
    "running": "pending",
    "waiting_for_hardware": "pending",
    "passed": "success",
    "failed": "failure",
    "needs_review": "failure",
    "inconclusive": "failure",
    "error": "error",
    "timed_out": "error",
}
CONCLUSION_FOR_STATE: dict[str, Conclusion] = {
    "passed": "success",
    "failed": "failure",
    "needs_review": "action_required",
    "inconclusive": "failure",
    "error": "failure",
    "timed_out": "timed_out",
}
STATUS_STATES: dict[str, StatusState] = {
    "pending": "pending",
    "success": "success",
    "failure": "failure",
    "error": "error",
}
CHECK_CONCLUSIONS: dict[str, Conclusion] = {
    "success": "success",
    "failure": "failure",
    "timed_out": "timed_out",
    "action_required": "action_required",
}


@dataclass(frozen=True)
class SyncResult:
    posted: int
    failed: int


def context_for(scope: str) -> str:
    return f"pathgate/{scope}"


def report_url(settings: Settings, submission_id: int) -> str:
    """The dashboard's page of the submission: a browser coming from GitHub signs in there (the
    API's report.html wants a bearer token, which a link cannot carry)."""
    return f"{settings.public_url.rstrip('/')}/dashboard/submissions/{submission_id}"


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def truncate_summary(markdown: str, full_report_url: str | None) -> str:
    if len(markdown) <= SUMMARY_MAX:
        return markdown
    where = f" The full report: {full_report_url}" if full_report_url else ""
    note = f"\n\n---\n*Truncated to GitHub's {SUMMARY_MAX}-character limit.{where}*\n"
    return markdown[: SUMMARY_MAX - len(note)] + note


def describe_verdict(session: Session, submission: Submission) -> str:
    """`PASS: cpu: <first reason>; gpu.h200.x1: ...`, within GitHub's 140 characters."""
    label = submission.verdict or submission.state.replace("_", " ")
    jobs = repo.jobs_of(session, submission.id)
    parts = [f"{job.queue}: {job.reason or job.state}" for job in jobs]
    return truncate(f"{label}: " + "; ".join(parts), DESCRIPTION_MAX)


def verdict_posting(session: Session, submission: Submission, settings: Settings) -> StatusPosting:
    """The status of a submission's state for its pull request: a finished one's final status
    and check run; one waiting for hardware (or just done waiting), a pending status only."""
    target = store.latest_posting(session, submission.id)
    assert target is not None
    url = report_url(settings, submission.id)
    conclusion = CONCLUSION_FOR_STATE.get(submission.state)
    summary = None
    if conclusion is not None:
        markdown = render_combined_markdown(combined_report(session, submission))
        summary = truncate_summary(markdown, url)
    return StatusPosting(
        submission_id=submission.id,
        repo=target.repo,
        sha=target.sha,
        context=target.context,
        state=STATUS_FOR_STATE[submission.state],
        description=describe_verdict(session, submission),
        target_url=url,
        check_conclusion=conclusion,
        check_summary=summary,
    )


def record_verdict(session: Session, submission_id: int, settings: Settings) -> int | None:
    """The posting to deliver for this submission's state, or None if there is none to post
    (not from a pull request, in a state without a status, or this very status was posted
    already)."""
    if not store.has_postings(session, submission_id):
        return None
    submission = repo.get_submission(session, submission_id, owner_id=None)
    if submission is None or submission.state not in STATUS_FOR_STATE:
        return None
    posting = verdict_posting(session, submission, settings)
    latest = store.latest_posting(session, submission_id)
    if latest is not None and (latest.state, latest.description) == (
        posting.state,
        posting.description,
    ):
        # a redelivered task: post the same row again only if its posting failed
        return None if latest.posted_at else latest.id
    return store.add_posting(session, posting).id


def post_verdict(submission_id: int, client: GitHubClient) -> str | None:
    """Record and post a finished submission's verdict; the error, if posting failed."""
    with session_scope() as session:
        posting_id = record_verdict(session, submission_id, get_settings())
    return deliver(posting_id, client) if posting_id is not None else None


def deliver(posting_id: int, client: GitHubClient) -> str | None:
    """Post one recorded status (and its check run); record the attempt. The error, if any."""
    with session_scope() as session:
        posting = store.get_posting(session, posting_id)
        assert posting is not None
        repo_name, sha = posting.repo, posting.sha
        status, check = _payloads(posting, client.app_auth)
    error = None
    try:
        client.post_status(repo_name, sha, status)
        if check is not None:
            client.create_check_run(repo_name, sha, check)
    except GitHubError as exc:
        error = str(exc)
    with session_scope() as session:
        store.record_attempt(session, posting_id, error)
    return error


def _payloads(posting: StatusPosting, app_auth: bool) -> tuple[CommitStatus, CheckRun | None]:
    status = CommitStatus(
        context=posting.context,
        state=STATUS_STATES[posting.state],
        description=truncate(posting.description, DESCRIPTION_MAX),
        target_url=posting.target_url,
    )
    if not (app_auth and posting.check_conclusion and posting.check_summary is not None):
        return status, None  # check runs need App auth: a plain token cannot create them
    check = CheckRun(
        name=posting.context,
        conclusion=CHECK_CONCLUSIONS[posting.check_conclusion],
        title=truncate(posting.description, DESCRIPTION_MAX),
        summary=posting.check_summary,
        details_url=posting.target_url,
    )
    return status, check


def resync(client: GitHubClient) -> SyncResult:
    """`pathgate github sync`: post again every posting whose posting failed, and the verdicts
    of finished pull-request submissions whose verdict task never ran."""
    with session_scope() as session:
        for submission_id in store.unreported_verdicts(session):
            record_verdict(session, submission_id, get_settings())
    with session_scope() as session:
        posting_ids = store.unposted_postings(session)
    errors = [deliver(posting_id, client) for posting_id in posting_ids]
    failed = sum(error is not None for error in errors)
    return SyncResult(posted=len(errors) - failed, failed=failed)
