"""The dashboard in a real browser: headless Chromium (the OS package) driven by Playwright,
against uvicorn on 127.0.0.1 with a SQLite file seeded from the real engine's evidence.

Screenshots land in pytest's tmp_path and are copied to pathgate-out/screenshots/ (ignored by
git) so a person can look at the pages a run produced.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from harness.api.app import create_app
from harness.store.db import engine_for, session_scope
from harness.store.migrate import upgrade
from tests.dashboard.seed import Seeded, seed_all
from tests.service_fixtures import use_database

CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")  # as .ci/run finds it
SCREENSHOTS = Path(__file__).resolve().parents[2] / "pathgate-out" / "screenshots"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs chromium on PATH (apt-get install -y --no-install-recommends chromium)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="needs the playwright package (pip install -e '.[dev]')",
    ),
]


@pytest.fixture
def seeded_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Seeded]]:
    url = f"sqlite:///{tmp_path / 'dashboard.db'}"
    use_database(monkeypatch, url)
    upgrade(url)
    with session_scope() as session:
        seeded = seed_all(session)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    config = uvicorn.Config(
        create_app(enqueue=lambda job, queue: None),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seeded
    server.should_exit = True
    thread.join(timeout=10)
    engine_for(url).dispose()
    engine_for.cache_clear()


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield instance
        instance.close()


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, SCREENSHOTS / path.name)


def _sign_in(page: Any, base: str, token: str) -> None:
    page.goto(f"{base}/dashboard/submissions")  # redirected to the sign-in form
    assert "/dashboard/login" in page.url
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{base}/dashboard/submissions")


def test_maintainer_reads_a_report_and_reviews_it(
    seeded_server: tuple[str, Seeded], browser: Any, tmp_path: Path
) -> None:
    base, seeded = seeded_server
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(60_000)  # a loaded CI machine can be slow to start Chromium
    _sign_in(page, base, seeded.tokens["maria"])
    assert page.locator("#submissions tr[data-id]").count() == 5
    _shot(page, tmp_path, "list-maintainer")

    page.click(f"a[href='/dashboard/submissions/{seeded.submissions['claims']}']")
    page.wait_for_selector("figure[data-figure=speedup] svg")
    for key in ("latency", "speedup", "errors", "kernels"):
        box = page.locator(f"figure[data-figure={key}] svg").first.bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100, key
    statuses = page.locator("table.claims tr[data-status]").evaluate_all(
        "rows => rows.map(r => r.dataset.status)"
    )
    assert set(statuses) == {"verified", "refuted", "inconclusive", "not_measurable"}
    _shot(page, tmp_path, "submission-report")
    page.screenshot(path=str(SCREENSHOTS / "submission-top.png"))
    page.locator("section.report").first.screenshot(path=str(SCREENSHOTS / "report-section.png"))
    page.locator("figure[data-figure=latency]").screenshot(path=str(tmp_path / "plot-latency.png"))
    shutil.copy(tmp_path / "plot-latency.png", SCREENSHOTS / "plot-latency.png")

    page.check("input[name=decision][value=approve]")
    page.fill("textarea[name=comment]", "Kernel count verified; <b>latency</b> claim needs fixing")
    page.click("#review-form button[type=submit]")
    page.wait_for_selector("#review-trail td >> text=approved")
    trail = page.locator("#review-trail").inner_text()
    assert "maria" in trail and "<b>latency</b> claim needs fixing" in trail
    _shot(page, tmp_path, "review-trail")
    page.locator("#reviews").scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / "review-trail-view.png"))


def test_contributor_sees_no_review_controls(
    seeded_server: tuple[str, Seeded], browser: Any, tmp_path: Path
) -> None:
    base, seeded = seeded_server
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(60_000)  # a loaded CI machine can be slow to start Chromium
    _sign_in(page, base, seeded.tokens["bob"])
    ids = page.locator("#submissions tr[data-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.id)"
    )
    assert sorted(int(i) for i in ids) == sorted(
        [seeded.submissions["cpu"], seeded.submissions["fail"]]
    )
    page.goto(f"{base}/dashboard/submissions/{seeded.submissions['fail']}")
    page.wait_for_selector("figure[data-figure=errors] svg")
    assert page.locator("#review-form").count() == 0
    assert page.locator("#review-trail").count() == 1
    _shot(page, tmp_path, "submission-contributor")


def test_compare_view_renders(
    seeded_server: tuple[str, Seeded], browser: Any, tmp_path: Path
) -> None:
    base, seeded = seeded_server
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(60_000)  # a loaded CI machine can be slow to start Chromium
    _sign_in(page, base, seeded.tokens["alice"])
    page.goto(f"{base}/dashboard/submissions/{seeded.submissions['h200']}")
    page.click("a.compare-link")
    page.wait_for_selector("#compare-table tr[data-case]")
    assert page.locator("#compare-table tr[data-case]").count() == 10
    box = page.locator("#figure-compare svg").bounding_box()
    assert box is not None and box["width"] > 100
    _shot(page, tmp_path, "compare")
