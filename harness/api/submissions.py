"""Routes: submit, list, read, reports, rerun, and checking a manifest without submitting."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, PlainTextResponse

from harness import submissions
from harness.api.deps import CurrentToken, Maintainer, SessionDep, owner_filter
from harness.api.schemas import (
    JobRead,
    ManifestCheck,
    ManifestValid,
    ServingResultRead,
    SubmissionCreate,
    SubmissionCreated,
    SubmissionPage,
    SubmissionRead,
    problem_responses,
)
from harness.config import get_settings
from harness.errors import InvalidInput, NotFound
from harness.evaluation.evidence import Verdict
from harness.json_input import UnreadableJson, load_json
from harness.reports.combined import combined_report, render_combined_html, render_combined_markdown
from harness.serving.vllm_import import VllmResultError, parse_vllm_result
from harness.store import repositories as repo
from harness.store.db import session_scope
from harness.store.models import ApiToken, ServingResult, Submission, SubmissionState
from workers.routing import queues_for_manifest

# Error bodies are declared (Problem) so the spec matches what the handlers send; fuzzing the spec
# (tests/api/test_openapi_fuzz.py) found every 422 contradicting FastAPI's default 422 schema.
router = APIRouter(prefix="/v1", responses=problem_responses(401, 413, 422, 429))
NOT_FOUND = problem_responses(404)
# Ids are 32-bit `integer` columns: a larger id overflowed in the driver (PostgreSQL "integer out
# of range", SQLite OverflowError past 64 bits) and came back as a 500; now it is a 422.
SubmissionId = Annotated[int, Path(ge=1, le=2**31 - 1)]
# A scope name is a slug. A NUL byte in the filter reached PostgreSQL, which rejects NUL in text
# parameters (a 500); anything outside the slug alphabet could never match, so it is a 422.
ScopeName = Annotated[str | None, Query(max_length=64, pattern=r"^[a-z0-9-]*$")]


JSON_BODY = problem_responses(415)


@router.post("/submissions", status_code=201, response_model=SubmissionCreated, responses=JSON_BODY)
def create_submission(
    body: SubmissionCreate, session: SessionDep, token: CurrentToken
) -> SubmissionCreated:
    source = submissions.Source(**body.source.model_dump())
    live = repo.live_queues(session, get_settings().worker_stale_after_s)
    submission = submissions.submit(session, body.manifest, source, token, live)
    return SubmissionCreated(id=submission.id, state=submission.state)


@router.get("/submissions", response_model=SubmissionPage)
def list_submissions(
    session: SessionDep,
    token: CurrentToken,
    state: Annotated[SubmissionState | None, Query()] = None,
    scope: ScopeName = None,
    verdict: Annotated[Verdict | None, Query()] = None,
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
    per_page: Annotated[int, Query(ge=1, le=200)] = 50,
) -> SubmissionPage:
    filters = repo.SubmissionFilter(state, scope, verdict, owner_filter(token))
    rows, total = repo.list_submissions(session, filters, (page - 1) * per_page, per_page)
    items = [SubmissionRead.model_validate(row) for row in rows]
    return SubmissionPage(items=items, total=total, page=page, per_page=per_page)


@router.get("/submissions/{submission_id}", response_model=SubmissionRead, responses=NOT_FOUND)
def read_submission(
    submission_id: SubmissionId, session: SessionDep, token: CurrentToken
) -> SubmissionRead:
    return SubmissionRead.model_validate(_visible(session, submission_id, token))


@router.get("/submissions/{submission_id}/report.json", responses=NOT_FOUND)
def report_json(submission_id: SubmissionId, session: SessionDep, token: CurrentToken) -> dict:
    submission = _visible(session, submission_id, token)
    return combined_report(session, submission)


@router.get(
    "/submissions/{submission_id}/report.md", response_class=PlainTextResponse, responses=NOT_FOUND
)
def report_markdown(submission_id: SubmissionId, session: SessionDep, token: CurrentToken) -> str:
    submission = _visible(session, submission_id, token)
    return render_combined_markdown(combined_report(session, submission))


@router.get(
    "/submissions/{submission_id}/report.html", response_class=HTMLResponse, responses=NOT_FOUND
)
def report_html(submission_id: SubmissionId, session: SessionDep, token: CurrentToken) -> str:
    submission = _visible(session, submission_id, token)
    return render_combined_html(combined_report(session, submission))


@router.get(
    "/submissions/{submission_id}/manifest.yaml",
    response_class=PlainTextResponse,
    responses=NOT_FOUND,
)
def manifest_yaml(
    submission_id: SubmissionId, session: SessionDep, token: CurrentToken
) -> PlainTextResponse:
    """The manifest as submitted: the file its reports' reproduce commands name."""
    submission = _visible(session, submission_id, token)
    name = submissions.manifest_file_name(submission.id)
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    return PlainTextResponse(
        submission.manifest_text, media_type="application/yaml", headers=headers
    )


@router.post(
    "/submissions/{submission_id}/rerun",
    status_code=201,
    response_model=list[JobRead],
    responses=problem_responses(403, 404),
)
def rerun(submission_id: SubmissionId, session: SessionDep, token: Maintainer) -> list[JobRead]:
    live = repo.live_queues(session, get_settings().worker_stale_after_s)
    jobs = submissions.rerun(session, submission_id, token, live)
    return [JobRead.model_validate(job) for job in jobs]


# A vLLM result with per-request lists (--save-detailed) of 10k requests is a few MB: this
# route's bodies are held to settings.max_serving_result_bytes, not max_body_bytes (app.py).
SERVING_RESULTS_PATH = r"/v1/submissions/\d+/serving-results"
SourceName = Annotated[str, Query(min_length=1, max_length=255, pattern=r"^[\w.+-]+$")]


@router.post(
    "/submissions/{submission_id}/serving-results",
    status_code=201,
    response_model=ServingResultRead,
    responses=problem_responses(404),
)
async def attach_serving_result(
    request: Request, submission_id: SubmissionId, name: SourceName, token: CurrentToken
) -> ServingResultRead:
    """Attach a `vllm bench serve --save-result` file (the request body, as vLLM wrote it) to a
    submission: it becomes evidence rows with its provenance (file name, sha256 of the body)."""
    raw = await request.body()
    return await run_in_threadpool(_attach, raw, submission_id, name, token)


def _attach(raw: bytes, submission_id: int, name: str, token: ApiToken) -> ServingResultRead:
    try:
        data = load_json(raw)
    except UnreadableJson as exc:
        raise InvalidInput(f"{name}: {exc}") from None
    try:
        imported = parse_vllm_result(data, name, hashlib.sha256(raw).hexdigest())
    except VllmResultError as exc:
        raise InvalidInput(str(exc)) from None
    with session_scope() as session:
        submission = _visible(session, submission_id, token)
        record = repo.add_serving_result(
            session,
            ServingResult(
                submission_id=submission.id,
                kind="vllm_bench_serve",
                source_name=name,
                sha256=imported.provenance.sha256,
                attached_by=token.name,
                data=imported.to_json(),
            ),
        )
        repo.record_audit(
            session,
            token.name,
            "serving_result.attach",
            f"submission:{submission.id}",
            {"serving_result": record.id, "sha256": record.sha256},
        )
        return ServingResultRead.model_validate(record)


@router.get(
    "/submissions/{submission_id}/serving-results",
    response_model=list[ServingResultRead],
    responses=NOT_FOUND,
)
def list_serving_results(
    submission_id: SubmissionId, session: SessionDep, token: CurrentToken
) -> list[ServingResultRead]:
    submission = _visible(session, submission_id, token)
    return [
        ServingResultRead.model_validate(r) for r in repo.serving_results_of(session, submission.id)
    ]


@router.post("/scopes/validate", response_model=ManifestValid, responses=JSON_BODY)
def validate_scope(body: ManifestCheck, request: Request, token: CurrentToken) -> ManifestValid:
    manifest, _ = submissions.parse_manifest(body.manifest)
    return ManifestValid(name=manifest.name, queues=queues_for_manifest(manifest))


def _visible(session: SessionDep, submission_id: int, token: CurrentToken) -> Submission:
    """Another contributor's submission is 404, not 403: its existence is not disclosed."""
    submission = repo.get_submission(session, submission_id, owner_filter(token))
    if submission is None:
        raise NotFound(f"no submission {submission_id}")
    return submission
