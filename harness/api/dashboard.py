"""The maintainer dashboard: server-rendered pages under /dashboard (no /v1: these are pages, not
the API, and they are left out of the OpenAPI document).

Sign-in takes an API token once (a form POST) and keeps a signed session cookie
(dashboard_session.py). Every form carries the session's CSRF token; a POST without the right one
is a 403. Contributors see their own submissions and no review controls; maintainers see all and
can approve or request changes, which is stored as a ReviewDecision and an AuditEvent.
Templates autoescape everything: evidence and comments carry submitted text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path as FilePath
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from markupsafe import Markup
from pydantic import ValidationError

from harness.api import dashboard_session as web
from harness.api.deps import SessionDep
from harness.config import get_settings
from harness.evaluation.evidence import VERDICTS, Evidence
from harness.reports.compare import compare_runs
from harness.reports.facts import SourceInfo
from harness.reports.html import (
    ReportCache,
    render_report_page,
    render_report_section,
    template_environment,
)
from harness.reports.markdown import render_markdown
from harness.reports.plots import LineChart, Series, line_chart
from harness.store import dashboard as store
from harness.store import repositories as repo
from harness.store.models import SUBMISSION_STATES, ApiToken, Job, Report, Submission

PREFIX = "/dashboard"
router = APIRouter(prefix=PREFIX, include_in_schema=False)
TEMPLATES = template_environment(FilePath(__file__).parent / "templates")
REPORT_CACHE = ReportCache(max_entries=128)
PER_PAGE = 50
DECISIONS = {"approve": "approved", "request_changes": "changes requested"}
MAX_COMMENT_CHARS = 4000
# Ids are 32-bit columns: a larger one would overflow in the driver (a 500); it is a 422 instead.
Id = Annotated[int, Query(ge=1, le=2**31 - 1)]
PathId = Annotated[int, Path(ge=1, le=2**31 - 1)]


@dataclass(frozen=True)
class Viewer:
    token: ApiToken
    session: web.WebSession

    @property
    def is_maintainer(self) -> bool:
        return self.token.role == "maintainer"

    @property
    def owner_id(self) -> int | None:
        """Contributors see only their own submissions; maintainers see all."""
        return None if self.is_maintainer else self.token.id


# --- sessions and rendering ------------------------------------------------------------------


def _cookie_session(request: Request) -> web.WebSession | None:
    settings = get_settings()
    cookie = request.cookies.get(web.COOKIE_NAME)
    return web.decode(cookie, settings.session_secret, settings.session_max_age_s)


def _viewer(request: Request, db: SessionDep) -> Viewer | None:
    session = _cookie_session(request)
    if session is None or session.token_id is None:
        return None
    token = store.active_token(db, session.token_id)
    return None if token is None else Viewer(token, session)


def _render(
    request: Request,
    template: str,
    status_code: int = 200,
    viewer: Viewer | None = None,
    **ctx: Any,
) -> HTMLResponse:
    """A page; a visitor without a session gets an anonymous one, so its forms carry CSRF."""
    session = viewer.session if viewer else _cookie_session(request)
    fresh = session is None
    session = session or web.anonymous()
    html = TEMPLATES.get_template(template).render(
        viewer=viewer, csrf=session.csrf, when=_when, **ctx
    )
    response = HTMLResponse(html, status_code=status_code)
    if fresh:
        _set_cookie(request, response, session)
    return response


def _set_cookie(request: Request, response: Response, session: web.WebSession) -> None:
    settings = get_settings()
    secure = request.url.scheme == "https"
    web.set_cookie(response, session, settings.session_secret, settings.session_max_age_s, secure)


def _error(
    request: Request, status: int, message: str, viewer: Viewer | None = None, kept: str = ""
) -> Response:
    """The error page; `kept` is text the person typed, shown back so that it is not lost."""
    return _render(request, "error.html", status, viewer, status=status, message=message, kept=kept)


def invalid_request_page(request: Request, errors: Sequence[Any]) -> Response:
    """A dashboard URL with a bad parameter (page=0, an id that is not a number): the HTML error
    page, not the API's JSON."""
    problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in errors)
    where = "form" if any(e["loc"][0] == "body" for e in errors) else "address"
    return _error(request, 422, f"This {where} has a value the dashboard cannot use ({problems}).")


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/dashboard/login?{urlencode({'next': target})}", status_code=303)


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    value = value if value.tzinfo else value.replace(tzinfo=UTC)  # SQLite drops the zone
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# --- sign-in ---------------------------------------------------------------------------------


@router.get("", response_class=HTMLResponse)
def home() -> RedirectResponse:
    return RedirectResponse("/dashboard/submissions", status_code=303)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/dashboard/submissions") -> Response:
    return _render(request, "login.html", next=_safe_next(next), message=None)


@router.post("/login", response_class=HTMLResponse)
def login(
    request: Request,
    db: SessionDep,
    token: Annotated[str, Form(max_length=200)] = "",
    csrf: Annotated[str, Form(max_length=200)] = "",
    next: Annotated[str, Form(max_length=500)] = "/dashboard/submissions",
) -> Response:
    if not web.csrf_ok(_cookie_session(request), csrf):
        return _error(request, 403, "The form expired or did not come from this site; reload it.")
    found = repo.find_token(db, token.strip()) if token.strip() else None
    if found is None:
        message = "Unknown or revoked API token."
        return _render(request, "login.html", 401, next=_safe_next(next), message=message)
    repo.record_audit(db, found.name, "dashboard.sign_in", f"token:{found.id}", {})
    response = RedirectResponse(_safe_next(next), status_code=303)
    _set_cookie(request, response, web.signed_in(found.id))
    return response


def _safe_next(target: str) -> str:
    """Only a path inside the dashboard: never an open redirect to another site."""
    if target.startswith("/dashboard") and not target.startswith("//") and "\\" not in target:
        return target
    return "/dashboard/submissions"


@router.post("/logout")
def logout(request: Request, csrf: Annotated[str, Form(max_length=200)] = "") -> Response:
    if not web.csrf_ok(_cookie_session(request), csrf):
        return _error(request, 403, "The form expired or did not come from this site; reload it.")
    response = RedirectResponse("/dashboard/login", status_code=303)
    web.clear_cookie(response)
    return response


# --- the list --------------------------------------------------------------------------------


@router.get("/submissions", response_class=HTMLResponse)
def submissions_list(
    request: Request,
    db: SessionDep,
    state: Annotated[str | None, Query(max_length=32)] = None,
    scope: Annotated[str | None, Query(max_length=64)] = None,
    verdict: Annotated[str | None, Query(max_length=16)] = None,
    submitter: Annotated[str | None, Query(max_length=100)] = None,
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> Response:
    viewer = _viewer(request, db)
    if viewer is None:
        return _to_login(request)
    filters = store.ListFilter(
        state=state if state in SUBMISSION_STATES else None,
        scope=_comparable(scope),
        verdict=verdict if verdict in VERDICTS else None,
        submitter=_comparable(submitter) if viewer.is_maintainer else None,
        owner_id=viewer.owner_id,
    )
    rows, total = store.list_page(db, filters, (page - 1) * PER_PAGE, PER_PAGE)
    pages = max(1, -(-total // PER_PAGE))
    if page > pages:  # past the end (an old link, a hand-typed page): the last page
        last = _query(filters, page=pages)
        return RedirectResponse(f"/dashboard/submissions?{last}", status_code=303)
    return _render(
        request,
        "list.html",
        viewer=viewer,
        rows=rows,
        total=total,
        page=page,
        pages=pages,
        filters=filters,
        query=lambda **changes: _query(filters, **changes),
        states=SUBMISSION_STATES,
        verdicts=VERDICTS,
        scopes=store.scopes(db, viewer.owner_id),
        submitters=store.submitters(db) if viewer.is_maintainer else [],
    )


def _comparable(text: str | None) -> str | None:
    """A free-text filter the store can compare: PostgreSQL's text holds no NUL, so no stored
    name has one, and the value is dropped like an unknown state instead of failing the query."""
    return text if text and "\x00" not in text else None


def _query(filters: store.ListFilter, **changes: Any) -> str:
    """The list's query string with some parameters changed (pagination keeps the filters)."""
    params = {
        "state": filters.state,
        "scope": filters.scope,
        "verdict": filters.verdict,
        "submitter": filters.submitter,
    } | changes
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    if kept.get("page") == 1:
        del kept["page"]
    return urlencode(kept)


# --- one submission --------------------------------------------------------------------------


@router.get("/submissions/{submission_id}", response_class=HTMLResponse)
def submission_page(request: Request, db: SessionDep, submission_id: PathId) -> Response:
    viewer = _viewer(request, db)
    if viewer is None:
        return _to_login(request)
    submission = repo.get_submission(db, submission_id, viewer.owner_id)
    if submission is None:
        return _error(request, 404, f"No submission {submission_id}.", viewer)
    reports = store.reports_by_job(db, [job.id for job in submission.jobs])
    source = _source(submission)
    return _render(
        request,
        "submission.html",
        viewer=viewer,
        submission=submission,
        submitter=store.submitter_name(db, submission),
        jobs=[_job_view(job, reports.get(job.id), source) for job in submission.jobs],
        runs=store.runs_of_scope(db, submission.scope, viewer.owner_id),
        reviews=store.reviews_of(db, submission.id),
        audit=store.audit_of(db, f"submission:{submission.id}"),
        decisions=DECISIONS,
    )


def _source(submission: Submission) -> SourceInfo:
    return SourceInfo(submission.source_kind, submission.source_url, submission.source_sha)


def _job_view(job: Job, report: Report | None, source: SourceInfo) -> dict[str, Any]:
    return {
        "job": job,
        "report": report,
        "queued_s": _seconds(job.created_at, job.started_at),
        "ran_s": _seconds(job.started_at, job.finished_at),
        "section": _section(report, source) if report else None,
    }


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    start = start if start.tzinfo else start.replace(tzinfo=UTC)
    end = end if end.tzinfo else end.replace(tzinfo=UTC)
    return (end - start).total_seconds()


def _section(report: Report, source: SourceInfo) -> Markup:
    def render() -> Markup:
        evidence = _evidence(report)
        if evidence is None:
            return Markup(
                "<p class='error-page'>This report's evidence does not match the "
                "current schema; download evidence.json to read it.</p>"
            )
        return render_report_section(evidence, source)

    return REPORT_CACHE.get_or_render(report.id, render)


def _evidence(report: Report) -> Evidence | None:
    try:
        return Evidence.model_validate(report.evidence)
    except ValidationError:
        return None


@router.post("/submissions/{submission_id}/review", response_class=HTMLResponse)
def review(
    request: Request,
    db: SessionDep,
    submission_id: PathId,
    decision: Annotated[str, Form(max_length=32)] = "",
    comment: Annotated[str, Form()] = "",  # its length checked below, where the text is kept
    csrf: Annotated[str, Form(max_length=200)] = "",
) -> Response:
    viewer = _viewer(request, db)
    if viewer is None or not web.csrf_ok(viewer.session, csrf):
        return _error(request, 403, "The form expired or did not come from this site; reload it.")
    if not viewer.is_maintainer:
        return _error(request, 403, "Only maintainers review submissions.", viewer)
    if decision not in DECISIONS:
        return _error(request, 422, "Choose approve or request changes.", viewer, comment)
    if len(comment) > MAX_COMMENT_CHARS:
        message = f"The comment has {len(comment)} characters; at most {MAX_COMMENT_CHARS} fit."
        return _error(request, 422, message, viewer, comment)
    submission = repo.get_submission(db, submission_id, owner_id=None)
    if submission is None:
        return _error(request, 404, f"No submission {submission_id}.", viewer)
    record = store.add_review(db, submission.id, viewer.token.id, decision, comment.strip())
    detail = {"review_id": record.id, "decision": decision, "comment": comment.strip()}
    repo.record_audit(
        db, viewer.token.name, f"review.{decision}", f"submission:{submission.id}", detail
    )
    return RedirectResponse(f"/dashboard/submissions/{submission.id}#reviews", status_code=303)


# --- artifacts -------------------------------------------------------------------------------


def _visible_report(
    request: Request, db: SessionDep, report_id: int
) -> tuple[Viewer, Report, Submission] | Response:
    viewer = _viewer(request, db)
    if viewer is None:
        return _to_login(request)
    found = store.report_with_submission(db, report_id, viewer.owner_id)
    if found is None:
        return _error(request, 404, f"No report {report_id}.", viewer)
    return viewer, found[0], found[2]


@router.get("/reports/{report_id}/evidence.json")
def evidence_json(request: Request, db: SessionDep, report_id: PathId) -> Response:
    found = _visible_report(request, db, report_id)
    if isinstance(found, Response):
        return found
    _, report, submission = found
    body = json.dumps(report.evidence, indent=1)
    name = f"evidence-{submission.scope}-report{report.id}.json"
    return Response(body, media_type="application/json", headers=_attachment(name))


@router.get("/reports/{report_id}/report.md")
def report_markdown(request: Request, db: SessionDep, report_id: PathId) -> Response:
    found = _visible_report(request, db, report_id)
    if isinstance(found, Response):
        return found
    _, report, submission = found
    evidence = _evidence(report)
    text = render_markdown(evidence, _source(submission)) if evidence else report.markdown
    name = f"report-{submission.scope}-report{report.id}.md"
    return PlainTextResponse(text, media_type="text/markdown", headers=_attachment(name))


@router.get("/reports/{report_id}/report.html", response_class=HTMLResponse)
def report_page(request: Request, db: SessionDep, report_id: PathId) -> Response:
    found = _visible_report(request, db, report_id)
    if isinstance(found, Response):
        return found
    viewer, report, submission = found
    evidence = _evidence(report)
    if evidence is None:
        return _error(request, 409, "This report's evidence does not match the schema.", viewer)
    return HTMLResponse(render_report_page(evidence, _source(submission)))


def _attachment(filename: str) -> dict[str, str]:
    # Scope names are slugs (the manifest validates them), so the name needs no quoting.
    return {"Content-Disposition": f'attachment; filename="{filename}"'}


# --- compare ---------------------------------------------------------------------------------


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, db: SessionDep, a: Id, b: Id) -> Response:
    viewer = _viewer(request, db)
    if viewer is None:
        return _to_login(request)
    first = store.report_with_submission(db, a, viewer.owner_id)
    second = store.report_with_submission(db, b, viewer.owner_id)
    if first is None or second is None:
        return _error(request, 404, "No such report (or not yours).", viewer)
    if first[2].scope != second[2].scope:
        return _error(request, 400, "Compare two runs of the same scope.", viewer)
    ev_a, ev_b = _evidence(first[0]), _evidence(second[0])
    if ev_a is None or ev_b is None:
        return _error(request, 409, "A report's evidence does not match the schema.", viewer)
    comparison = compare_runs(ev_a, ev_b)
    return _render(
        request,
        "compare.html",
        viewer=viewer,
        runs=[(first, ev_a), (second, ev_b)],
        comparison=comparison,
        plot=Markup(_compare_plot(ev_a, ev_b, a, b)),
    )


def _compare_plot(ev_a: Evidence, ev_b: Evidence, a: int, b: int) -> str:
    """One line per run and context (a colour per context, run B dashed); one line per run over
    every context went back and forth between the contexts."""
    contexts = sorted({c.context or 0 for e in (ev_a, ev_b) for c in e.cases if c.performance})
    series = []
    for run, (label, evidence) in enumerate(((f"report {a}", ev_a), (f"report {b}", ev_b))):
        for color, context in enumerate(contexts):
            timed = sorted(
                (c for c in evidence.cases if c.performance and (c.context or 0) == context),
                key=lambda c: c.batch,
            )
            perfs = [(c.batch, c.performance) for c in timed if c.performance]
            points = [(x, p.candidate_us_median) for x, p in perfs]
            name = f"{label} c{context}" if context else label
            errors = [p.candidate_us_ci95 for _, p in perfs]
            series.append(Series(name, points, errors, color, dashed=run == 1))
    chart = LineChart("Candidate latency per layer, two runs", "batch", "µs per layer", series)
    return line_chart(chart)
