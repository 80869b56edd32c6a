"""The HTML report: the Markdown's content plus per-case tables and plots, escaped, cached."""

from __future__ import annotations

import re

from markupsafe import Markup

from harness.reports.facts import SourceInfo
from harness.reports.html import ReportCache, render_report_page, render_report_section
from tests.reports.evidence_fixtures import load, many_cases


def test_section_shows_claims_cases_plots_and_reproduce() -> None:
    evidence = load("h200_claims")
    html = str(render_report_section(evidence, SourceInfo("in_tree")))
    statuses = re.findall(r'<tr data-status="(\w+)">', html)
    assert statuses == [c.status for c in evidence.claims]
    assert ">not measurable here</span>" in html and ">refuted</span>" in html
    assert len(re.findall(r'<tr data-case="', html)) == len(evidence.cases)
    assert re.findall(r'data-figure="(\w+)"', html) == ["latency", "speedup", "errors", "kernels"]
    assert html.count("<svg ") == 4
    assert f'<pre class="reproduce">{evidence.run.command}</pre>' in html
    assert "candidate source</th><td>in-tree" in html


def test_every_case_is_listed_in_html_even_when_markdown_summarizes() -> None:
    evidence = many_cases()
    html = render_report_page(evidence)
    assert html.startswith("<!doctype html>")
    assert len(re.findall(r'<tr data-case="', html)) == len(evidence.cases)


def test_each_median_is_printed_inside_its_printed_interval() -> None:
    """Medians to 3 significant figures beside intervals to 4 read "157 [157.1, 157.4]"."""
    html = str(render_report_section(load("h200_claims")))
    cells = re.findall(r'<td class="num">(-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\]</td>', html)
    assert len(cells) >= 3 * 12  # stock, candidate and speedup of each case
    for median, low, high in cells:
        assert float(low) <= float(median) <= float(high), (median, low, high)
        assert len(median.split(".")[1]) == len(low.split(".")[1]) == len(high.split(".")[1])


def test_submitted_text_is_escaped() -> None:
    evidence = load("cpu_offgrid_fail")
    evidence.cases[0] = evidence.cases[0].model_copy(update={"reasons": ["<img src=x onerror=1>"]})
    html = str(render_report_section(evidence))
    assert "<img" not in html
    assert "&lt;img src=x onerror=1&gt;" in html


def test_cache_is_bounded_and_renders_once() -> None:
    cache = ReportCache(max_entries=2)
    calls: list[int] = []

    def render(n: int) -> Markup:
        calls.append(n)
        return Markup(str(n))

    assert cache.get_or_render(1, lambda: render(1)) == "1"
    assert cache.get_or_render(1, lambda: render(1)) == "1"
    cache.get_or_render(2, lambda: render(2))
    cache.get_or_render(3, lambda: render(3))  # drops 1, the least recently used
    assert len(cache) == 2
    cache.get_or_render(1, lambda: render(1))
    assert calls == [1, 2, 3, 1]


def test_combined_submission_page_has_each_jobs_report() -> None:
    from harness.reports.combined import render_combined_html

    evidence = load("h200_claims")
    report = {
        "submission": 7,
        "scope": evidence.scope,
        "state": "failed",
        "verdict": "FAIL",
        "verdict_reasons": ["gpu.h200.x1: FAIL", "cpu: <waiting>"],
        "source": {"kind": "in_tree", "url": None, "sha": None},
        "jobs": [
            {
                "id": 1,
                "queue": "cpu",
                "state": "waiting_for_hardware",
                "reason": "no <worker>",
                "attempts": 0,
                "evidence": None,
                "markdown": None,
            },
            {
                "id": 2,
                "queue": "gpu.h200.x1",
                "state": "failed",
                "reason": None,
                "attempts": 1,
                "evidence": evidence.model_dump(mode="json"),
                "markdown": "# x",
            },
        ],
        "serving_results": [],
    }
    html = render_combined_html(report)
    assert (
        "<h2>Job 1 on <code>cpu</code>: waiting_for_hardware</h2><p>no &lt;worker&gt;</p>" in html
    )
    assert "cpu: &lt;waiting&gt;" in html
    assert html.count("<svg ") == 4 and evidence.run.command in html


def test_the_kernel_chart_samples_every_batch_and_says_so() -> None:
    """It kept the first 48 of 72 cases and dropped the largest batches without a word."""
    evidence = many_cases(copies=6, failing_copies=0)  # 72 timed cases
    html = str(render_report_section(evidence))
    figure = html.split('data-figure="kernels"', 1)[1].split("</svg>", 1)[0]
    assert "Kernels per layer (48 of 72 timed cases, evenly spaced)" in figure
    assert figure.count('<rect class="bar"') == 2 * 48
