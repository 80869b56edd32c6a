"""The dashboard's pages through the real app, on SQLite and the real PostgreSQL: sign-in into a
signed session cookie, CSRF on every form, what contributors and maintainers may see and do,
the list's filters and pages, artifacts, compare, and the review trail."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from harness.api import dashboard_session as web
from harness.api.app import create_app
from harness.config import get_settings
from harness.store.db import session_scope
from harness.store.models import AuditEvent, ReviewDecision
from tests.dashboard.seed import SHA, Seeded, add_run, seed_all
from tests.reports.evidence_fixtures import load


@pytest.fixture
def seeded(database_url: str) -> Seeded:
    with session_scope() as session:
        return seed_all(session)


@pytest.fixture
def client(seeded: Seeded) -> Iterator[TestClient]:
    with TestClient(create_app(enqueue=lambda job, queue: None)) as test_client:
        yield test_client


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


def sign_in(client: TestClient, token: str) -> None:
    form = client.get("/dashboard/login")
    response = client.post(
        "/dashboard/login",
        data={"token": token, "csrf": _csrf(form.text), "next": "/dashboard/submissions"},
        follow_redirects=False,
    )
    assert response.status_code == 303, response.text


def test_pages_need_a_session(client: TestClient) -> None:
    response = client.get("/dashboard/submissions?state=failed", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == (
        "/dashboard/login?next=%2Fdashboard%2Fsubmissions%3Fstate%3Dfailed"
    )
    assert (
        client.get("/dashboard/reports/1/evidence.json", follow_redirects=False).status_code == 303
    )


def test_sign_in_sets_a_signed_httponly_lax_cookie(client: TestClient, seeded: Seeded) -> None:
    form = client.get("/dashboard/login")
    response = client.post(
        "/dashboard/login",
        data={"token": seeded.tokens["maria"], "csrf": _csrf(form.text)},
        follow_redirects=False,
    )
    assert response.status_code == 303
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{web.COOKIE_NAME}=")
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/dashboard" in cookie
    assert f"Max-Age={get_settings().session_max_age_s}" in cookie
    assert seeded.tokens["maria"] not in cookie  # the cookie holds the token's id, not the token
    page = client.get("/dashboard/submissions")
    assert "signed in as <b>maria</b> (maintainer)" in page.text


def test_sign_in_without_csrf_is_403_and_a_bad_token_is_401(
    client: TestClient, seeded: Seeded
) -> None:
    client.get("/dashboard/login")
    no_csrf = client.post("/dashboard/login", data={"token": seeded.tokens["maria"]})
    assert no_csrf.status_code == 403
    form = client.get("/dashboard/login")
    bad = client.post("/dashboard/login", data={"token": "pg_nope", "csrf": _csrf(form.text)})
    assert bad.status_code == 401 and "Unknown or revoked API token." in bad.text


def test_a_tampered_or_expired_cookie_is_no_session(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["maria"])
    value = client.cookies[web.COOKIE_NAME]
    body, signature = value.split(".")
    forged = web.encode(web.WebSession(1, "x", int(time.time())), "not the secret")
    for bad in (f"{body}.{'0' * len(signature)}", forged, "garbage"):
        client.cookies.set(web.COOKIE_NAME, bad, path="/dashboard")
        assert client.get("/dashboard/submissions", follow_redirects=False).status_code == 303
    secret = get_settings().session_secret
    old = web.WebSession(1, "x", int(time.time()) - get_settings().session_max_age_s - 1)
    assert web.decode(web.encode(old, secret), secret, get_settings().session_max_age_s) is None


def test_sign_out_needs_csrf_and_ends_the_session(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["alice"])
    assert client.post("/dashboard/logout", data={}).status_code == 403
    page = client.get("/dashboard/submissions")
    out = client.post("/dashboard/logout", data={"csrf": _csrf(page.text)}, follow_redirects=False)
    assert out.status_code == 303
    assert client.get("/dashboard/submissions", follow_redirects=False).status_code == 303


def test_revoking_the_token_ends_its_dashboard_session(client: TestClient, seeded: Seeded) -> None:
    from harness.store import repositories as repo

    sign_in(client, seeded.tokens["alice"])
    assert client.get("/dashboard/submissions", follow_redirects=False).status_code == 200
    with session_scope() as session:
        token = repo.find_token(session, seeded.tokens["alice"])
        assert token is not None
        repo.revoke_token(session, token.id)
    assert client.get("/dashboard/submissions", follow_redirects=False).status_code == 303


def test_contributors_see_only_their_own(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["bob"])
    page = client.get("/dashboard/submissions").text
    ids = {int(i) for i in re.findall(r'<tr data-id="(\d+)">', page)}
    assert ids == {seeded.submissions["cpu"], seeded.submissions["fail"]}
    assert 'name="submitter"' not in page
    other = client.get(f"/dashboard/submissions/{seeded.submissions['h200']}")
    assert other.status_code == 404
    other_report = client.get(f"/dashboard/reports/{seeded.reports['h200']}/evidence.json")
    assert other_report.status_code == 404
    own = client.get(f"/dashboard/submissions/{seeded.submissions['fail']}")
    assert own.status_code == 200 and "review-form" not in own.text


def test_a_contributor_cannot_review(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["bob"])
    submission = seeded.submissions["fail"]
    page = client.get(f"/dashboard/submissions/{submission}")
    response = client.post(
        f"/dashboard/submissions/{submission}/review",
        data={"decision": "approve", "comment": "mine", "csrf": _csrf(page.text)},
    )
    assert response.status_code == 403
    with session_scope() as session:
        assert session.scalars(select(ReviewDecision)).all() == []


def test_maintainer_reviews_and_sees_the_trail(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["maria"])
    submission = seeded.submissions["claims"]
    url = f"/dashboard/submissions/{submission}"
    page = client.get(url)
    assert 'id="review-form"' in page.text
    assert client.post(f"{url}/review", data={"decision": "approve"}).status_code == 403
    comment = "Latency claim is refuted: <script>alert(1)</script>"
    response = client.post(
        f"{url}/review",
        data={"decision": "request_changes", "comment": comment, "csrf": _csrf(page.text)},
        follow_redirects=False,
    )
    assert response.status_code == 303
    trail = client.get(url).text
    assert "changes requested" in trail
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in trail and "<script>alert" not in trail
    with session_scope() as session:
        review = session.scalars(select(ReviewDecision)).one()
        assert (review.submission_id, review.decision) == (submission, "request_changes")
        event = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "review.request_changes")
        ).one()
        assert (event.actor, event.subject) == ("maria", f"submission:{submission}")
        assert event.detail["comment"] == comment


def test_a_comment_too_long_is_refused_and_shown_back(client: TestClient, seeded: Seeded) -> None:
    """The form's maxlength holds only in a browser; past it the comment was thrown away
    behind a message about 'this address'."""
    sign_in(client, seeded.tokens["maria"])
    url = f"/dashboard/submissions/{seeded.submissions['claims']}"
    comment = "<b>long</b> " * 400  # 4800 characters
    response = client.post(
        f"{url}/review",
        data={"decision": "approve", "comment": comment, "csrf": _csrf(client.get(url).text)},
    )
    assert response.status_code == 422
    assert "The comment has 4800 characters; at most 4000 fit." in response.text
    assert "&lt;b&gt;long&lt;/b&gt; " * 400 in response.text  # kept, and escaped
    assert "address" not in response.text
    with session_scope() as session:
        assert session.scalars(select(ReviewDecision)).all() == []


def test_list_filters_and_pages(client: TestClient, seeded: Seeded) -> None:
    with session_scope() as session:
        from harness.store import repositories as repo

        alice = repo.find_token(session, seeded.tokens["alice"])
        assert alice is not None
        for _ in range(55):
            add_run(session, alice, "cpu_rmsnorm")
    sign_in(client, seeded.tokens["maria"])

    def ids(query: str) -> list[int]:
        page = client.get(f"/dashboard/submissions?{query}")
        assert page.status_code == 200
        return [int(i) for i in re.findall(r'<tr data-id="(\d+)">', page.text)]

    first, second = ids(""), ids("page=2")
    assert len(first) == 50 and len(second) == 10 and first[0] > second[0]
    assert set(ids("verdict=FAIL")) == {seeded.submissions["claims"], seeded.submissions["fail"]}
    assert ids("state=passed") == [seeded.submissions["h200_rerun"]]
    assert ids("state=failed&submitter=alice") == [seeded.submissions["claims"]]
    assert set(ids("submitter=bob")) == {seeded.submissions["cpu"], seeded.submissions["fail"]}
    assert len(ids("scope=fused-add-rmsnorm-h200&submitter=alice&page=2")) == 7
    nav = client.get("/dashboard/submissions?submitter=alice").text
    assert 'href="/dashboard/submissions?submitter=alice&amp;page=2"' in nav
    assert ids("state=nonsense") == first  # an unknown filter value filters nothing
    # PostgreSQL's text cannot hold NUL: such a filter failed the query (500)
    assert ids("scope=%00") == ids("submitter=a%00b") == first
    # a scope no submission has: the filter stays visible instead of reading "any"
    page = client.get("/dashboard/submissions?scope=%3Cscript%3Ex").text
    assert "0 submissions" in page
    assert '<option value="&lt;script&gt;x" selected>&lt;script&gt;x (no submissions)' in page
    # past the last page: the last page, filters kept
    past = client.get("/dashboard/submissions?submitter=alice&page=999", follow_redirects=False)
    assert past.status_code == 303
    assert past.headers["location"] == "/dashboard/submissions?submitter=alice&page=2"


def test_submission_page_shows_jobs_log_report_and_artifacts(
    client: TestClient, seeded: Seeded
) -> None:
    sign_in(client, seeded.tokens["alice"])
    report_id = seeded.reports["h200"]
    page = client.get(f"/dashboard/submissions/{seeded.submissions['h200']}").text
    assert "<code>gpu.h200.x1</code>" in page and "h200-0" in page and "2.0 s" in page
    assert "&lt;b&gt;not markup&lt;/b&gt;" in page  # the log tail is escaped
    assert f'href="/dashboard/reports/{report_id}/evidence.json"' in page
    assert page.count("<svg ") >= 4 and "verdict-PASS" in page
    assert f"/dashboard/compare?a={report_id}&amp;b={seeded.reports['h200_rerun']}" in page

    evidence = client.get(f"/dashboard/reports/{report_id}/evidence.json")
    assert evidence.status_code == 200 and "attachment" in evidence.headers["content-disposition"]
    assert json.loads(evidence.text)["run"] == load("h200_rmsnorm").model_dump(mode="json")["run"]
    markdown = client.get(f"/dashboard/reports/{report_id}/report.md")
    assert markdown.headers["content-type"].startswith("text/markdown")
    assert load("h200_rmsnorm").run.command in markdown.text
    assert f"https://example.com/kernels.git at {SHA}" in markdown.text  # the candidate SHA
    assert client.get(f"/dashboard/reports/{report_id}/report.html").text.count("<svg ") == 4


def test_compare_two_runs_of_one_scope(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["maria"])
    a, b = seeded.reports["h200"], seeded.reports["h200_rerun"]
    page = client.get(f"/dashboard/compare?a={a}&b={b}")
    assert page.status_code == 200
    rows = re.findall(r'<tr data-case="([^"]+)">', page.text)
    assert rows and all(" cp=1 " in r for r in rows) and len(rows) == 10
    assert '<figure id="figure-compare"><svg ' in page.text
    other = client.get(f"/dashboard/compare?a={a}&b={seeded.reports['claims']}")
    assert other.status_code == 400


def test_dashboard_stays_out_of_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/dashboard")]


def test_out_of_range_ids_are_422_not_500(client: TestClient, seeded: Seeded) -> None:
    sign_in(client, seeded.tokens["maria"])
    huge = 2**64
    for url in (
        f"/dashboard/submissions/{huge}",
        f"/dashboard/reports/{huge}/evidence.json",
        f"/dashboard/compare?a=1&b={huge}",
    ):
        assert client.get(url).status_code == 422, url
    assert client.get("/dashboard/submissions/999999").status_code == 404


@pytest.mark.parametrize(
    "url",
    [
        "/dashboard/submissions?page=0",
        "/dashboard/submissions?page=abc",
        "/dashboard/submissions/abc",
        "/dashboard/compare?a=1",
    ],
)
def test_a_bad_dashboard_address_gets_the_html_error_page(
    client: TestClient, seeded: Seeded, url: str
) -> None:
    """It got the API's JSON body, meant for programs, in a person's browser."""
    sign_in(client, seeded.tokens["maria"])
    response = client.get(url)
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("text/html")
    assert "<h1>422</h1>" in response.text
    assert "the dashboard cannot use" in response.text
    assert client.get("/v1/submissions?page=0").headers["content-type"] == "application/json"


def test_the_compare_plot_draws_one_line_per_run_and_context() -> None:
    """One line per run over every context went back and forth between the contexts."""
    from harness.api.dashboard import _compare_plot
    from tests.reports.evidence_fixtures import load

    evidence = load("h200_rmsnorm")
    cases = [
        case.model_copy(update={"context": 1024 if i % 2 else 32768})
        for i, case in enumerate(evidence.cases)
    ]
    evidence = evidence.model_copy(update={"cases": cases})
    svg = _compare_plot(evidence, evidence, 1, 2)
    lines = re.findall(r'<polyline points="([^"]*)"', svg)
    assert len(lines) == 4  # two runs x two contexts
    for line in lines:
        xs = [float(point.split(",")[0]) for point in line.split()]
        assert xs == sorted(xs)
    assert svg.count('stroke-dasharray="6 4"/>') >= 2  # run B's lines
