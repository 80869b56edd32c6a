"""Seed the store the way the service fills it: tokens, submissions through the submission
service, and each job's evidence recorded with `record_evidence` from the real engine fixtures
(tests/reports/evidence_fixtures.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from harness import submissions
from harness.evaluation.evidence import Evidence
from harness.store import repositories as repo
from harness.store.models import ApiToken, Job, Submission
from tests.reports.evidence_fixtures import load

SHA = "0123456789abcdef0123456789abcdef01234567"
LOG_TAIL = "worker h200-0: running job\nevaluation child exited 0\n<b>not markup</b>\n"


@dataclass
class Seeded:
    tokens: dict[str, str] = field(default_factory=dict)  # name -> plaintext
    submissions: dict[str, int] = field(default_factory=dict)  # label -> submission id
    reports: dict[str, int] = field(default_factory=dict)  # label -> report id


def add_token(session: Session, seeded: Seeded, name: str, role: str) -> ApiToken:
    token, plaintext = repo.create_token(session, name, role)
    seeded.tokens[name] = plaintext
    return token


def add_run(
    session: Session, owner: ApiToken, fixture: str, *more: str, git: bool = False
) -> tuple[Submission, int]:
    """A submission of the fixture's manifest whose job on the fixture's hardware finished with
    the fixture's evidence (and the jobs of `more` fixtures of the same scope with theirs);
    returns the submission and the first fixture's report id."""
    evidence = load(fixture)
    source = (
        submissions.Source("git", "https://example.com/kernels.git", SHA)
        if git
        else submissions.Source("in_tree")
    )
    submission = submissions.submit(session, evidence.manifest, source, owner, live_queues=set())
    report_ids = [_finish(session, submission, load(name)) for name in (fixture, *more)]
    submissions.refresh_state(session, submission)
    session.flush()
    return submission, report_ids[0]


def _finish(session: Session, submission: Submission, evidence: Evidence) -> int:
    queue = "cpu" if evidence.run.device == "cpu" else "gpu.h200.x1"
    job = next(j for j in repo.jobs_of(session, submission.id) if j.queue == queue)
    _start(job)
    submissions.record_evidence(session, job, evidence, LOG_TAIL)
    # The job ran as long as the evidence's run did.
    ran = datetime.fromisoformat(evidence.run.finished_at) - datetime.fromisoformat(
        evidence.run.started_at
    )
    job.finished_at = job.started_at + ran if job.started_at else None
    session.flush()
    report = repo.reports_of(session, [job.id])[0]
    return report.id


def _start(job: Job) -> None:
    job.worker = "h200-0" if job.queue != "cpu" else "cpu-0"
    job.started_at = job.created_at + timedelta(seconds=2)


def seed_all(session: Session) -> Seeded:
    """alice (contributor) has the H200 runs, bob (contributor) the CPU ones; maria reviews."""
    seeded = Seeded()
    alice = add_token(session, seeded, "alice", "contributor")
    bob = add_token(session, seeded, "bob", "contributor")
    add_token(session, seeded, "maria", "maintainer")
    # The rerun has both jobs done (H200 and CPU; the same manifest): a combined PASS. The first
    # H200 run was made with an earlier version of the manifest (two claims), so it stands alone
    # and its CPU job waits for hardware.
    for label, owner, fixtures, git in (
        ("h200", alice, ("h200_rmsnorm",), True),
        ("h200_rerun", alice, ("h200_rmsnorm_rerun", "cpu_rmsnorm"), False),
        ("claims", alice, ("h200_claims",), False),
        ("cpu", bob, ("cpu_rmsnorm",), False),
        ("fail", bob, ("cpu_offgrid_fail",), False),
    ):
        submission, report_id = add_run(session, owner, *fixtures, git=git)
        seeded.submissions[label] = submission.id
        seeded.reports[label] = report_id
    return seeded
