"""The evidence report as HTML: the Markdown's content plus per-case tables and SVG plots.

`render_report_section` gives the fragment the dashboard embeds; `render_report_page` a
standalone page. Templates autoescape: evidence carries submitted text. Rendered sections are
cached by report id in memory (a report never changes once stored; see ReportCache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from harness.evaluation.evidence import CaseEvidence, Evidence
from harness.evaluation.stats import with_ci
from harness.reports import facts
from harness.reports.facts import SourceInfo
from harness.reports.plots import LineChart, RefLine, Series, bar_chart, line_chart

TEMPLATES = Path(__file__).parent / "templates"
MAX_BAR_CATEGORIES = 48


def template_environment(*extra_dirs: Path) -> Environment:
    """A Jinja2 environment that escapes everything HTML; the dashboard adds its own folder."""
    return Environment(
        loader=FileSystemLoader([*extra_dirs, TEMPLATES]),
        autoescape=select_autoescape(["html"], default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


_ENV = template_environment()


@dataclass(frozen=True)
class Figure:
    key: str  # stable name, used as the figure's element id
    caption: str
    svg: Markup


def render_report_section(evidence: Evidence, source: SourceInfo | None = None) -> Markup:
    context = report_context(evidence, source)
    return Markup(_ENV.get_template("report_section.html").render(**context))


def render_report_page(evidence: Evidence, source: SourceInfo | None = None) -> str:
    section = render_report_section(evidence, source)
    title = f"pathgate: {evidence.scope}: {evidence.verdict}"
    return _ENV.get_template("report_page.html").render(title=title, sections=[section])


def render_sections_page(title: str, sections: list[Markup]) -> str:
    return _ENV.get_template("report_page.html").render(title=title, sections=sections)


def report_context(evidence: Evidence, source: SourceInfo | None) -> dict[str, object]:
    return {
        "ev": evidence,
        "warnings": facts.warnings(evidence),
        "claims": facts.claim_rows(evidence),
        "correctness": facts.correctness_summary(evidence),
        "decode_check": facts.decode_check_line(evidence),
        "coverage": facts.coverage(evidence),
        "kernel_summary": facts.kernel_summary(evidence),
        "environment": facts.environment_rows(evidence, source),
        "figures": report_figures(evidence),
        "case_rows": [_case_row(c) for c in evidence.cases],
        "error_rows": [row for c in evidence.cases for row in _error_rows(c)],
        "fmt": facts.fmt,
    }


def _case_row(case: CaseEvidence) -> dict[str, object]:
    perf = case.performance
    row: dict[str, object] = {
        "case": case,
        "ratio": facts.fmt(facts.error_ratio(case), 3),
    }
    if perf is not None:
        row |= {  # a median and its interval to the same decimals, as in report.md
            "stock": with_ci(perf.stock_us_median, perf.stock_us_ci95, 2, "f"),
            "candidate": with_ci(perf.candidate_us_median, perf.candidate_us_ci95, 2, "f"),
            "speedup": facts.speedup_with_ci(perf),
            "kernels": facts.kernel_pair(perf),
            "hbm": facts.fmt(perf.candidate_hbm_fraction, 3),
            "pairs": len(perf.candidate_us),
            "method": perf.method,
        }
    return row


def _error_rows(case: CaseEvidence) -> Iterable[dict[str, object]]:
    """Per case and output: the worst trial's errors vs the float64 reference."""
    if case.correctness is None:
        return []
    worst: dict[str, dict[str, object]] = {}
    for trial in case.correctness.trials:
        for out in trial.outputs:
            seen = worst.get(out.name)
            if seen is None or out.error_ratio > float(str(seen["ratio"])):
                worst[out.name] = {
                    "case": case.id,
                    "output": out.name,
                    "candidate_error": f"{out.candidate_error:.3e}",
                    "stock_error": f"{out.stock_error:.3e}",
                    "ratio": f"{out.error_ratio:.4g}",
                    "cosine": f"{out.cosine:.6f}",
                    "status": case.correctness.status,
                }
    return worst.values()


# --- figures ---------------------------------------------------------------------------------


def report_figures(evidence: Evidence) -> list[Figure]:
    groups = _groups(evidence.cases)
    timed = {label: [c for c in cases if c.performance] for label, cases in groups.items()}
    timed = {label: cases for label, cases in timed.items() if cases}
    figures = []
    if timed:
        figures += [
            _figure("latency", "Latency per layer vs batch, stock dashed", _latency(timed)),
            _figure("speedup", "Speedup vs batch, claims in red", _speedup(evidence, timed)),
        ]
    checked = {
        label: [c for c in cases if c.correctness and c.correctness.trials]
        for label, cases in groups.items()
    }
    if any(checked.values()):
        figures.append(_figure("errors", "Error vs the float64 reference", _errors(checked)))
    if timed:
        figures.append(_figure("kernels", "Kernels per layer per case", _kernels(evidence)))
    return figures


def _figure(key: str, caption: str, svg: str) -> Figure:
    return Figure(key=key, caption=caption, svg=Markup(svg))


def _groups(cases: list[CaseEvidence]) -> dict[str, list[CaseEvidence]]:
    """Cases by everything but batch (context, CP, GPUs, dtype), each sorted by batch: one line
    per group. The label names only what varies, so a batch-only scope has one unlabelled group."""
    keys = {_group_key(c) for c in cases}
    varying = [len({k[i] for k in keys}) > 1 for i in range(4)]
    groups: dict[str, list[CaseEvidence]] = {}
    for case in sorted(cases, key=lambda c: (c.context or 0, c.cp, c.gpus, c.dtype, c.batch)):
        groups.setdefault(_group_label(_group_key(case), varying), []).append(case)
    return groups


def _group_key(case: CaseEvidence) -> tuple[int | None, int, int, str]:
    return case.context, case.cp, case.gpus, case.dtype


def _group_label(key: tuple[int | None, int, int, str], varying: list[bool]) -> str:
    names = ("context=", "cp=", "gpus=", "")
    parts = [f"{name}{value}" for name, value, on in zip(names, key, varying, strict=True) if on]
    return " ".join(parts)


def _named(path: str, label: str) -> str:
    return f"{path} {label}" if label else path


def _latency(timed: dict[str, list[CaseEvidence]]) -> str:
    series = []
    for color, (label, cases) in enumerate(timed.items()):
        perfs = [(c.batch, c.performance) for c in cases if c.performance]
        series += [
            Series(
                _named("stock", label),
                [(b, p.stock_us_median) for b, p in perfs],
                [p.stock_us_ci95 for _, p in perfs],
                2 * color + 1,
                dashed=True,
            ),
            Series(
                _named("candidate", label),
                [(b, p.candidate_us_median) for b, p in perfs],
                [p.candidate_us_ci95 for _, p in perfs],
                2 * color,
            ),
        ]
    return line_chart(LineChart("Latency per layer", "batch", "µs per layer", series))


def _speedup(evidence: Evidence, timed: dict[str, list[CaseEvidence]]) -> str:
    series = []
    for color, (label, cases) in enumerate(timed.items()):
        perfs = [(c.batch, c.performance) for c in cases if c.performance]
        points = [(b, p.speedup) for b, p in perfs]
        series.append(
            Series(_named("speedup", label), points, [p.speedup_ci95 for _, p in perfs], color)
        )
    refs = [
        _claim_line(claim.claim)
        for claim in evidence.claims
        if claim.claim.get("metric") == "speedup"
    ]
    chart = LineChart("Speedup (stock / candidate)", "batch", "speedup (x)", series, refs)
    return line_chart(chart)


def _claim_line(claim: dict[str, object]) -> RefLine:
    bound = claim.get("at_least", claim.get("at_most"))
    sign = ">=" if claim.get("at_least") is not None else "<="
    value = float(bound) if isinstance(bound, int | float) else 0.0
    where = claim.get("where")
    parts = [f"claim {sign} {value:g}"]
    if isinstance(where, dict) and where:
        parts.append(",".join(f"{k}={v}" for k, v in where.items()))
    if claim.get("hardware"):
        parts.append(f"on {claim['hardware']}")
    return RefLine(value, " ".join(parts))


def _errors(checked: dict[str, list[CaseEvidence]]) -> str:
    series = []
    for color, (label, cases) in enumerate(checked.items()):
        worst = [(c.batch, *_worst_errors(c)) for c in cases if _has_outputs(c)]
        series += [
            Series(
                _named("stock", label), [(b, s) for b, _, s in worst], None, 2 * color + 1, True
            ),
            Series(_named("candidate", label), [(b, k) for b, k, _ in worst], None, 2 * color),
        ]
    chart = LineChart(
        "Relative error vs float64 reference (worst trial)",
        "batch",
        "relative L2 error",
        series,
        log10_y=True,
    )
    return line_chart(chart)


def _has_outputs(case: CaseEvidence) -> bool:
    # a case whose problem declared no outputs (failed for it) has no error to plot
    return case.correctness is not None and any(t.outputs for t in case.correctness.trials)


def _worst_errors(case: CaseEvidence) -> tuple[float, float]:
    """(candidate, stock) error of the output and trial where the candidate was furthest off."""
    assert case.correctness is not None
    outputs = [o for t in case.correctness.trials for o in t.outputs]
    worst = max(outputs, key=lambda o: o.candidate_error)
    return worst.candidate_error, worst.stock_error


def _kernels(evidence: Evidence) -> str:
    timed = [c for c in evidence.cases if c.performance]
    title = "Kernels per layer"
    if any(facts.counts_ops(c.performance) for c in timed):
        title = "Torch ops per layer (counted on the CPU: not GPU kernels)"
    if len(timed) > MAX_BAR_CATEGORIES:  # evenly spaced from first to last, and said so
        title += f" ({MAX_BAR_CATEGORIES} of {len(timed)} timed cases, evenly spaced)"
        timed = facts.even_sample(timed, MAX_BAR_CATEGORIES)
    timed.sort(key=lambda c: (c.context or 0, c.batch))
    labels = [_short_label(c) for c in timed]
    stock = [_kernel_value(c, stock=True) for c in timed]
    candidate = [_kernel_value(c, stock=False) for c in timed]
    groups = [("stock", stock), ("candidate", candidate)]
    # the same colours as the latency plot: candidate PALETTE[0], stock PALETTE[1]
    return bar_chart(title, "kernels", labels, groups, colors=[1, 0])


def _short_label(case: CaseEvidence) -> str:
    context = f" c{case.context}" if case.context is not None else ""
    return f"b{case.batch}{context}"


def _kernel_value(case: CaseEvidence, stock: bool) -> float:
    perf = case.performance
    assert perf is not None
    value = perf.stock_kernels_per_layer if stock else perf.candidate_kernels_per_layer
    return float("nan") if value is None else value


# --- cache -----------------------------------------------------------------------------------


class ReportCache:
    """Rendered report sections by report id, least recently used dropped past `max_entries`.

    A Report row is append-only (a rerun is a new row), so an id's rendering never goes stale.
    It lives in this process's memory: each API process renders a report once; a restart
    starts cold. Storing the SVGs in the Report row would need a migration.
    """

    def __init__(self, max_entries: int = 128) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, Markup] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_render(self, report_id: int, render: Callable[[], Markup]) -> Markup:
        with self._lock:
            if report_id in self._entries:
                self._entries.move_to_end(report_id)
                return self._entries[report_id]
        rendered = render()  # outside the lock: rendering a large report takes a while
        with self._lock:
            self._entries[report_id] = rendered
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return rendered

    def __len__(self) -> int:
        return len(self._entries)
