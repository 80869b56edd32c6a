"""The SVG plots: valid XML, the expected series, log-2 batch ticks, error bars, escaped text."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from harness.reports.html import report_figures
from harness.reports.plots import LineChart, RefLine, Series, bar_chart, line_chart
from tests.reports.evidence_fixtures import load, many_cases

NS = {"svg": "http://www.w3.org/2000/svg"}


def _parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


def _series(root: ET.Element) -> dict[str, ET.Element]:
    return {g.attrib["data-series"]: g for g in root.iterfind(".//svg:g[@class='series']", NS)}


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iterfind(".//svg:text", NS)]


def test_report_figures_from_h200_evidence() -> None:
    evidence = load("h200_claims")
    figures = {f.key: _parse(str(f.svg)) for f in report_figures(evidence)}
    assert list(figures) == ["latency", "speedup", "errors", "kernels"]

    latency = _series(figures["latency"])
    assert list(latency) == ["stock", "candidate"]
    for group in latency.values():
        assert len(group.findall("svg:circle", NS)) == len(evidence.cases)
        assert len(group.findall("svg:path[@class='error-bar']", NS)) == len(evidence.cases)
    assert {"1", "2", "4", "8", "16", "32", "64", "128", "256", "512"} <= set(
        _texts(figures["latency"])
    )

    speedup = figures["speedup"]
    assert list(_series(speedup)) == ["speedup"]
    refs = [g.attrib["data-label"] for g in speedup.iterfind(".//svg:g[@class='ref-line']", NS)]
    assert refs == [
        "claim >= 1.8 on GB300",
        "claim >= 9.7 batch=1 on H200",
        "claim >= 9.8 batch=1 on H200",
        "claim >= 9.9 batch=1 on H200",
    ]

    assert list(_series(figures["errors"])) == ["stock", "candidate"]
    bars = figures["kernels"].findall(".//svg:rect[@class='bar']", NS)
    assert len(bars) == 2 * len(evidence.cases)


def test_cpu_failing_case_has_errors_but_no_timing() -> None:
    evidence = load("cpu_offgrid_fail")
    figures = {f.key: _parse(str(f.svg)) for f in report_figures(evidence)}
    timed = [c for c in evidence.cases if c.performance]
    latency = _series(figures["latency"])["candidate"]
    assert len(latency.findall("svg:circle", NS)) == len(timed) == len(evidence.cases) - 1
    errors = _series(figures["errors"])["candidate"]
    assert len(errors.findall("svg:circle", NS)) == len(evidence.cases)


def test_figures_of_hundreds_of_cases_stay_valid() -> None:
    figures = report_figures(many_cases())
    for figure in figures:
        _parse(str(figure.svg))


def test_text_is_escaped() -> None:
    hostile = '<script>alert("x")</script> & co'
    chart = LineChart(
        hostile, hostile, hostile, [Series(hostile, [(1, 2.0), (4, 3.0)])], [RefLine(2.5, hostile)]
    )
    root = _parse(line_chart(chart))
    assert hostile in _series(root)
    assert not root.findall(".//svg:script", NS)
    _parse(bar_chart(hostile, hostile, [hostile], [(hostile, [1.0])]))


def test_log_y_axis_and_empty_data() -> None:
    chart = LineChart("e", "batch", "err", [Series("a", [(1, 1e-4), (8, 3e-2)])], log10_y=True)
    assert {"1e-04", "0.001", "0.01", "0.1"} <= set(_texts(_parse(line_chart(chart))))
    empty = _parse(line_chart(LineChart("none", "x", "y", [])))
    assert "no data to plot" in _texts(empty)
