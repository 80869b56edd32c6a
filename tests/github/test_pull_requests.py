"""The pull-request flow against a fake GitHub: changed manifests become submissions with pending
statuses, a bad manifest gets a failure status with its messages, forks of first-time
contributors wait for the approval label, and a finished job's verdict is posted (a check run
with the report under App auth). The job itself really runs: a git checkout of the pull
request's head SHA (a local repository) evaluated in a child process on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import select

from harness.config import get_settings
from harness.github import tasks as github_tasks
from harness.github.client import get_client
from harness.github.hooks import PULL_REQUEST_TASK, VERDICT_TASK
from harness.github.models import StatusPosting
from harness.github.pull_requests import process_event
from harness.store import github as store
from harness.store.db import session_scope
from harness.store.models import ApiToken, Job, Submission
from tests.github.conftest import (
    PUBLIC_URL,
    REPO,
    JobRecorder,
    PullRequest,
    TaskRecorder,
    deliver,
    git_repo,
    set_env,
)
from tests.github.fake_github import FakeGitHub
from workers.runner import run_in_child
from workers.tasks import finish_job, start_job

CANDIDATE = '''"""A contributed path: the stock add+RMSNorm, dispatching like a real candidate."""

from kernels.fused_add_rmsnorm import stock


def supports(case):
    return case.dtype == "bfloat16" and 1 <= case.batch <= 64 and case.cp == 1 and case.gpus == 1


def forward(weights, inputs, out):
    stock.forward(weights, inputs, out)
'''
BAD_MANIFEST = "name: broken-scope\nsummary: no path\nworkload: {phase: sideways}\n"


def scope_yaml(name: str) -> str:
    return yaml.safe_dump(
        {
            "name": name,
            "summary": "the stock add+RMSNorm as a contributed candidate, on CPU",
            "path": {
                "problem": "kernels.fused_add_rmsnorm.problem:Problem",
                "baseline": "kernels.fused_add_rmsnorm.stock:forward",
                "candidate": "contrib_rmsnorm:forward",
                "supports": "contrib_rmsnorm:supports",
            },
            "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": 256}},
            "hardware": {"gpu": ["cpu"], "gpus": [1]},
            "workload": {"phase": "decode", "batch": {"min": 1, "max": 64}},
            "claims": [],
        }
    )


def open_pull_request(
    tmp_path: Path, fake: FakeGitHub, number: int = 7, **kwargs: object
) -> PullRequest:
    """A contribution in a local git repository, as a pull request the fake GitHub serves."""
    files = {
        "scopes/contrib-rmsnorm-cpu.yaml": scope_yaml("contrib-rmsnorm-cpu"),
        "scopes/broken.yaml": BAD_MANIFEST,
        "contrib_rmsnorm.py": CANDIDATE,
        "README.md": "a contribution\n",
    }
    url, sha = git_repo(tmp_path / f"contrib-{number}", files)
    fake.add_pull_request(REPO, number, sha, {**files, "scopes/old.yaml": ""})
    return PullRequest(number=number, sha=sha, clone_url=url, **kwargs)  # type: ignore[arg-type]


def run_github_tasks(tasks: TaskRecorder, jobs: JobRecorder) -> None:
    """What the "github" worker would do with the tasks sent so far."""
    for event_id in tasks.take(PULL_REQUEST_TASK):
        process_event(event_id, get_client(get_settings()), jobs)
    for submission_id in tasks.take(VERDICT_TASK):
        github_tasks.post_verdict(submission_id)


def submissions() -> list[Submission]:
    with session_scope() as session:
        return list(session.scalars(select(Submission).order_by(Submission.id)))


def test_pull_request_to_verdict_with_app_auth(
    client: TestClient,
    tasks: TaskRecorder,
    fake_app: FakeGitHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, job_timeout_s="120")
    pr = open_pull_request(tmp_path, fake_app)
    jobs = JobRecorder()
    assert deliver(client, "pull_request", pr.payload("opened")).status_code == 202
    run_github_tasks(tasks, jobs)

    [submission] = submissions()
    assert (submission.scope, submission.source_kind) == ("contrib-rmsnorm-cpu", "git")
    assert (submission.source_url, submission.source_sha) == (pr.clone_url, pr.sha)
    with session_scope() as session:
        submitter = session.get(ApiToken, submission.submitter_id)
        assert submitter is not None and (submitter.name, submitter.role) == (
            "github",
            "contributor",
        )
    [(job_id, queue)] = jobs.sent
    assert queue == "cpu"

    statuses = {c.body["context"]: c.body for c in fake_app.posted("statuses")}
    report = f"{PUBLIC_URL}/dashboard/submissions/{submission.id}"
    assert statuses["pathgate/contrib-rmsnorm-cpu"]["state"] == "pending"
    assert statuses["pathgate/contrib-rmsnorm-cpu"]["target_url"] == report
    broken = statuses["pathgate/broken-scope"]
    assert broken["state"] == "failure" and broken["description"].startswith(
        "invalid scopes/broken.yaml: "
    )
    assert "workload.phase" in broken["description"]
    [invalid_run] = fake_app.posted("check-runs")
    assert invalid_run.body["conclusion"] == "failure"
    assert invalid_run.body["head_sha"] == pr.sha
    assert "- path: Field required" in invalid_run.body["output"]["summary"]
    assert "- workload.phase (line 3)" in invalid_run.body["output"]["summary"]

    # the worker's side: check out the head SHA, run the evaluation in a child, record it
    started = start_job(job_id, "test-worker")
    assert started is not None
    # no worker had served "cpu" (the status said so): the pull request hears it runs now
    assert tasks.sent == [(VERDICT_TASK, submission.id)]
    run_github_tasks(tasks, jobs)
    running = fake_app.posted("statuses")[-1].body
    assert (running["state"], running["description"]) == ("pending", "running: cpu: running")
    assert len(fake_app.posted("check-runs")) == 1  # a pending status has no check run
    finish_job(job_id, run_in_child(started.request))
    assert tasks.sent == [(VERDICT_TASK, submission.id)]  # enqueued after the job's commit
    run_github_tasks(tasks, jobs)

    final = fake_app.posted("statuses")[-1].body
    assert final["context"] == "pathgate/contrib-rmsnorm-cpu"
    assert (final["state"], final["target_url"]) == ("success", report)
    assert final["description"].startswith("PASS: cpu: ") and len(final["description"]) <= 140
    verdict_run = fake_app.posted("check-runs")[-1].body
    assert (verdict_run["name"], verdict_run["conclusion"]) == (
        "pathgate/contrib-rmsnorm-cpu",
        "success",
    )
    assert verdict_run["output"]["summary"].startswith(
        f"# Submission {submission.id}: contrib-rmsnorm-cpu: **PASS**"
    )
    # one installation lookup and one installation token serve every call (the token is cached)
    assert len(fake_app.installation_tokens) == 1
    assert fake_app.problems == []


@pytest.mark.parametrize("change", ["renamed", "copied"])
def test_a_manifest_renamed_or_copied_into_scopes_is_validated(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path, change: str
) -> None:
    pr = open_pull_request(tmp_path, fake_token)
    fake_token.pull_files[(REPO, pr.number)] = [
        (path, change if path == "scopes/contrib-rmsnorm-cpu.yaml" else status)
        for path, status in fake_token.pull_files[(REPO, pr.number)]
    ]
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    [submission] = submissions()
    assert submission.scope == "contrib-rmsnorm-cpu"
    contexts = {c.body["context"] for c in fake_token.posted("statuses")}
    assert contexts == {"pathgate/contrib-rmsnorm-cpu", "pathgate/broken-scope"}  # not old.yaml


def test_a_bad_manifest_gets_a_failure_status_with_its_messages_under_token_auth(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    pr = open_pull_request(tmp_path, fake_token)
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    by_context = {c.body["context"]: c for c in fake_token.posted("statuses")}
    broken = by_context["pathgate/broken-scope"]
    assert broken.authorization == "token ghp_test_token"
    assert broken.body["state"] == "failure"
    # without App auth there are no check runs: the messages are in the (140-char) description
    description = broken.body["description"]
    assert len(description) <= 140 and "path: Field required" in description
    assert fake_token.posted("check-runs") == []
    assert fake_token.problems == []


def test_redelivered_and_relabeled_events_submit_nothing_twice(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    pr = open_pull_request(tmp_path, fake_token)
    deliver(client, "pull_request", pr.payload("opened"))
    deliver(client, "pull_request", pr.payload("reopened"))
    deliver(client, "pull_request", pr.payload("labeled", label="pathgate:approved"))
    run_github_tasks(tasks, JobRecorder())
    assert len(submissions()) == 1


def test_a_first_timers_fork_waits_for_the_approval_label(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    pr = open_pull_request(tmp_path, fake_token, fork=True, association="FIRST_TIME_CONTRIBUTOR")
    jobs = JobRecorder()
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, jobs)
    assert submissions() == [] and jobs.sent == []
    waiting = {c.body["context"]: c.body for c in fake_token.posted("statuses")}
    assert waiting["pathgate/contrib-rmsnorm-cpu"]["state"] == "pending"
    assert (
        "waiting for a maintainer's approval"
        in waiting["pathgate/contrib-rmsnorm-cpu"]["description"]
    )

    approved = PullRequest(
        pr.number, pr.sha, pr.clone_url, True, "FIRST_TIME_CONTRIBUTOR", ("pathgate:approved",)
    )
    deliver(client, "pull_request", approved.payload("labeled", label="pathgate:approved"))
    run_github_tasks(tasks, jobs)
    [submission] = submissions()
    assert submission.source_url == pr.clone_url and len(jobs.sent) == 1
    last = fake_token.posted("statuses")[-1].body  # the broken manifest is not answered again
    assert (last["context"], last["state"]) == ("pathgate/contrib-rmsnorm-cpu", "pending")
    assert last["description"].startswith(f"submission {submission.id}: ")


@pytest.mark.parametrize("association", ["MEMBER", "CONTRIBUTOR"])
def test_a_known_contributors_fork_runs_at_once(
    client: TestClient,
    tasks: TaskRecorder,
    fake_token: FakeGitHub,
    tmp_path: Path,
    association: str,
) -> None:
    pr = open_pull_request(tmp_path, fake_token, fork=True, association=association)
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    assert len(submissions()) == 1


def test_the_fork_policy_can_be_turned_off(
    client: TestClient,
    tasks: TaskRecorder,
    fake_token: FakeGitHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, github_require_approval_for_forks="false")
    pr = open_pull_request(tmp_path, fake_token, fork=True, association="NONE")
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    assert len(submissions()) == 1


def test_every_posting_is_recorded(
    client: TestClient, tasks: TaskRecorder, fake_token: FakeGitHub, tmp_path: Path
) -> None:
    pr = open_pull_request(tmp_path, fake_token)
    deliver(client, "pull_request", pr.payload("opened"))
    run_github_tasks(tasks, JobRecorder())
    with session_scope() as session:
        rows = list(session.scalars(select(StatusPosting).order_by(StatusPosting.context)))
        assert [(r.context, r.state, r.attempts, r.last_error) for r in rows] == [
            ("pathgate/broken-scope", "failure", 1, None),
            ("pathgate/contrib-rmsnorm-cpu", "pending", 1, None),
        ]
        assert all(r.posted_at is not None and r.sha == pr.sha for r in rows)
        assert store.unposted_postings(session) == []
        assert session.scalar(select(Job.queue)) == "cpu"
