"""The submission service: the logic between the API (or a task) and the store.

Submitting validates the manifest, stores the submission with one job per hardware target, and
arranges for the jobs to be enqueued once the transaction commits. Recording an outcome stores
the job's evidence (append-only) and recomputes the submission's state and verdict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from sqlalchemy import event
from sqlalchemy.orm import Session

from harness.config import get_settings
from harness.errors import InvalidInput, NotFound
from harness.evaluation.evidence import STATE_OF_VERDICT, Evidence, Verdict
from harness.github import hooks as github_hooks
from harness.reports.markdown import render_markdown
from harness.store import repositories as repo
from harness.store.models import (
    FINISHED_STATES,
    ApiToken,
    CaseResult,
    Job,
    Report,
    Submission,
    utcnow,
)
from scopes.manifest import ManifestError, ScopeManifest, load_manifest, validate_manifest
from workers.routing import queues_for_manifest
from workers.workspace import git_protocol

log = logging.getLogger(__name__)

Enqueue = Callable[[int, str], None]  # (job id, queue)


def manifest_file_name(submission_id: int) -> str:
    """The submitted manifest's file name: its download's, and its run's reproduce command's."""
    return f"submission-{submission_id}.yaml"


@dataclass(frozen=True)
class Source:
    kind: Literal["in_tree", "git"]
    url: str | None = None
    sha: str | None = None


def parse_manifest(body: str | dict[str, Any]) -> tuple[ScopeManifest, str]:
    """The validated manifest and its text; InvalidInput (422) lists every problem."""
    try:
        if isinstance(body, str):
            text = body
        else:  # through its YAML text, to meet the same checks (node count, lone surrogates,
            # numbers too long to read) as a manifest sent as text
            text = yaml.safe_dump(body, sort_keys=False, allow_unicode=True)
        return load_manifest(text), text
    except ManifestError as exc:
        details = [
            {
                "loc": ["body", "manifest", *p.field.split(".")]
                if p.field
                else ["body", "manifest"],
                "msg": p.message,
                # a line of the YAML text the sender wrote; an object's dump is ours, not theirs
                "line": p.line if isinstance(body, str) else None,
            }
            for p in exc.problems
        ]
        raise InvalidInput("invalid scope manifest", details) from None
    except RecursionError:
        # Deeply nested YAML ("[[[[...") exhausts the parser's recursion: reject it, don't 500.
        loc = ["body", "manifest"]
        details = [{"loc": loc, "msg": "nested too deeply to parse", "line": None}]
        raise InvalidInput("invalid scope manifest", details) from None


def _check_git_protocol(source: Source, allowed: list[str]) -> None:
    if source.kind != "git" or source.url is None:
        return
    protocol = git_protocol(source.url)
    if protocol not in allowed:
        message = f"git {protocol} URLs are not accepted here (allowed: {', '.join(allowed)})"
        loc = ["body", "source", "url"]
        raise InvalidInput("invalid source", [{"loc": loc, "msg": message}])


def submit(
    session: Session,
    body: str | dict[str, Any],
    source: Source,
    submitter: ApiToken,
    live_queues: set[str],
) -> Submission:
    manifest, text = parse_manifest(body)
    _check_git_protocol(source, get_settings().git_protocols)
    submission = Submission(
        scope=manifest.name,
        manifest_text=text,
        manifest=manifest.model_dump(mode="json"),
        source_kind=source.kind,
        source_url=source.url,
        source_sha=source.sha,
        submitter_id=submitter.id,
        state="queued",
    )
    jobs = repo.add_submission(session, submission, queues_for_manifest(manifest))
    _route(session, jobs, live_queues)
    # The jobs just added are the whole current round: no need to read them back (one query
    # less per submission; benchmarks/api_load.py).
    refresh_state(session, submission, jobs)
    repo.record_audit(
        session,
        submitter.name,
        "submission.create",
        f"submission:{submission.id}",
        {"scope": manifest.name, "queues": [j.queue for j in jobs]},
    )
    return submission


def rerun(
    session: Session, submission_id: int, actor: ApiToken, live_queues: set[str]
) -> list[Job]:
    """New jobs for every hardware target; earlier jobs and their evidence stay as they were."""
    submission = repo.get_submission(session, submission_id, owner_id=None)
    if submission is None:
        raise NotFound(f"no submission {submission_id}")
    manifest = validate_manifest(submission.manifest)
    jobs = repo.add_jobs(session, submission, queues_for_manifest(manifest))
    _route(session, jobs, live_queues)
    refresh_state(session, submission, jobs)
    repo.record_audit(
        session,
        actor.name,
        "submission.rerun",
        f"submission:{submission.id}",
        {"jobs": [j.id for j in jobs]},
    )
    return jobs


def _route(session: Session, jobs: list[Job], live_queues: set[str]) -> None:
    """Every job is enqueued; one whose queue no live worker serves says so while it waits."""
    for job in jobs:
        if job.queue not in live_queues:
            job.state = "waiting_for_hardware"
            job.reason = f"no live worker serves queue {job.queue}"
        enqueue_after_commit(session, job)


def enqueue_after_commit(session: Session, job: Job) -> None:
    """Send the job once the session commits. Its enqueued_at is when it was sent: the sweeper
    sends a job again when no worker took it for a while (its message lost, or never sent)."""
    job.enqueued_at = utcnow()
    session.info.setdefault("pending_enqueues", []).append((job.id, job.queue))


def install_enqueue_hook(session: Session, enqueue: Enqueue) -> None:
    """Send the session's pending jobs to the broker only once its transaction has committed, so a
    worker never receives a job id that is not in the database yet."""

    @event.listens_for(session, "after_commit")
    def _send(committed: Session) -> None:
        pending = committed.info.pop("pending_enqueues", [])
        for job_id, queue in pending:
            try:
                enqueue(job_id, queue)
            except Exception:  # the job is stored: the sweeper sends it again (enqueued_at)
                log.exception("job %s: could not reach the broker for queue %s", job_id, queue)

    @event.listens_for(session, "after_rollback")
    def _drop(rolled_back: Session) -> None:
        rolled_back.info.pop("pending_enqueues", None)


def refresh_state(session: Session, submission: Submission, jobs: list[Job] | None = None) -> None:
    """The submission's state and verdict from its current round of jobs."""
    previous = submission.state
    jobs = jobs if jobs is not None else _current_round(repo.jobs_of(session, submission.id))
    states = {job.state for job in jobs}
    verdicts = [job.verdict for job in jobs if job.verdict]
    if "FAIL" in verdicts:
        submission.state, submission.verdict = "failed", "FAIL"
    elif "running" in states:
        submission.state = "running"
    elif "queued" in states:
        submission.state = "queued"
    elif "waiting_for_hardware" in states:
        submission.state = "waiting_for_hardware"
    else:
        _finish_submission(session, submission, jobs)
    submission.verdict_reasons = _reasons(session, submission, jobs)
    github_hooks.note_state_change(session, submission, previous)


def _current_round(jobs: list[Job]) -> list[Job]:
    """The latest job per queue: a rerun replaces the previous round in the summary only."""
    latest: dict[str, Job] = {}
    for job in jobs:
        latest[job.queue] = job
    return list(latest.values())


def _finish_submission(session: Session, submission: Submission, jobs: list[Job]) -> None:
    states = {job.state for job in jobs}
    for state in ("timed_out", "error"):
        if state in states:
            submission.state, submission.verdict = state, None
            return
    evidences = [
        Evidence.model_validate(r.evidence) for r in repo.reports_of(session, [j.id for j in jobs])
    ]
    verdict = combined_verdict(evidences)
    submission.verdict = verdict
    submission.state = STATE_OF_VERDICT[verdict]


def combined_verdict(evidences: list[Evidence]) -> Verdict:
    """One verdict over jobs on different hardware: a claim counts as verified when some job
    verified it and none left it open (inconclusive) or refuted it; a job that could not
    measure it (other hardware) does not count against it."""
    if not evidences or any(e.verdict == "FAIL" for e in evidences):
        return "FAIL" if evidences else "INCONCLUSIVE"
    if any(e.verdict == "NEEDS_REVIEW" for e in evidences):
        return "NEEDS_REVIEW"
    if not any(e.cases for e in evidences):
        return "INCONCLUSIVE"
    # Claims are matched by their description, so jobs that judged different claim lists (a
    # manifest changed between rounds) never index past each other.
    claims = {claim.description for e in evidences for claim in e.claims}
    verified = {c.description for e in evidences for c in e.claims if c.status == "verified"}
    disputed = {
        c.description
        for e in evidences
        for c in e.claims
        if c.status in ("inconclusive", "refuted")
    }
    return "PASS" if claims <= verified - disputed else "INCONCLUSIVE"


def _reasons(session: Session, submission: Submission, jobs: list[Job]) -> list[str]:
    reasons = []
    for job in jobs:
        if job.state in FINISHED_STATES and job.state not in ("error", "timed_out"):
            reasons.append(f"{job.queue}: {job.verdict}")
        elif job.reason:
            reasons.append(f"{job.queue}: {job.state}: {job.reason}")
        else:
            reasons.append(f"{job.queue}: {job.state}")
    return reasons


def record_evidence(session: Session, job: Job, evidence: Evidence, log_tail: str) -> None:
    """Store a finished job's evidence, its case results and its report, once."""
    environment_id = repo.fingerprint_id(session, evidence.environment)
    results = [
        CaseResult(
            job_id=job.id,
            case_id=c.id,
            kind="case",
            origin=c.origin,
            status=c.status,
            reasons=c.reasons,
            correctness=c.correctness.model_dump(mode="json") if c.correctness else None,
            performance=c.performance.model_dump(mode="json") if c.performance else None,
        )
        for c in evidence.cases
    ] + [
        CaseResult(
            job_id=job.id,
            case_id=p.id,
            kind="probe",
            origin=p.origin,
            status=p.status,
            reasons=p.reasons,
            correctness=None,
            performance=None,
        )
        for p in evidence.probes
    ]
    report = Report(
        job_id=job.id,
        environment_id=environment_id,
        verdict=evidence.verdict,
        evidence=json.loads(evidence.model_dump_json()),
        markdown=render_markdown(evidence),
    )
    repo.add_report(session, report, results)
    job.state = STATE_OF_VERDICT[evidence.verdict]
    job.verdict = evidence.verdict
    job.reason = _summary(evidence.verdict_reasons)
    _close(job, log_tail)


def _summary(reasons: list[str], shown: int = 3) -> str:
    """The first reasons, and how many more the report holds (a job's line, not its report)."""
    more = len(reasons) - shown
    return "; ".join(reasons[:shown]) + (f"; and {more} more in the report" if more > 0 else "")


def record_failure(session: Session, job: Job, state: str, reason: str, log_tail: str) -> None:
    """A job that ended without evidence: `error` (the child crashed), `timed_out`, or `failed`
    (the submitted code took its worker down every time: a FAIL, not an infrastructure error)."""
    job.state, job.reason = state, reason
    if state == "failed":
        job.verdict = "FAIL"
    _close(job, log_tail)


def _close(job: Job, log_tail: str) -> None:
    job.finished_at = utcnow()
    job.log_tail = log_tail[-8000:]
