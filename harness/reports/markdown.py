"""The evidence report as Markdown: verdict and reasons first, then warnings, claims, correctness,
cases, kernels, scope coverage, environment and the command that reproduces the run.

It is what a GitHub check-run summary shows, so it stays under GitHub's 65,535
characters: with many cases it lists the failing ones and a sample, and says so; the HTML report
and evidence.json hold every case.
"""

from __future__ import annotations

import re

from harness.evaluation.evidence import CaseEvidence, Evidence
from harness.reports import facts
from harness.reports.facts import SourceInfo

GITHUB_LIMIT_CHARS = 65_535
# Room under GitHub's limit for what a caller wraps around the report (a combined summary).
BUDGET_CHARS = 60_000
MAX_CASE_ROWS = 40
MAX_LISTED = 20  # verdict reasons, failing cases, not-run items
# What could open an HTML tag or comment: a "<" before a letter, "/", "!" or "?" ("<= 2" is fine).
TAG_OPENER = re.compile(r"<(?=[A-Za-z/!?])")

# Kept for callers that word a claim status the way the report does.
CLAIM_STATUS_WORDS = {
    key: f"**{words}**" if key == "refuted" else words
    for key, words in facts.CLAIM_STATUS_WORDS.items()
}


def render_markdown(evidence: Evidence, source: SourceInfo | None = None) -> str:
    lines = [f"# pathgate: {evidence.scope}: **{evidence.verdict}**", ""]
    lines += _capped([f"- {inline_text(r)}" for r in evidence.verdict_reasons], "verdict reasons")
    lines += [""] + [f"> {inline_text(note)}" for note in evidence.notes]
    lines += [""] if evidence.notes else []
    lines += _warnings(evidence) + _claims(evidence) + _correctness(evidence)
    lines += _decode_check(evidence)
    lines += _cases(evidence) + _kernels(evidence) + _coverage(evidence)
    lines += _environment(evidence, source)
    lines += ["## Reproduce", "", "```", evidence.run.command, "```", ""]
    return _within_budget("\n".join(lines))


def inline_text(value: object) -> str:
    # Evidence carries submitted text (exception messages, names): keep it from opening HTML
    # (GitHub renders inline HTML) or breaking a table row.
    return TAG_OPENER.sub("&lt;", str(value)).replace("|", "\\|").replace("\n", " ")


def _capped(lines: list[str], what: str) -> list[str]:
    if len(lines) <= MAX_LISTED:
        return lines
    rest = len(lines) - MAX_LISTED
    return [*lines[:MAX_LISTED], f"- ... and {rest} more {what} (see the HTML report)"]


def _decode_check(evidence: Evidence) -> list[str]:
    line = facts.decode_check_line(evidence)
    return [] if line is None else ["## Model-level decode check", "", inline_text(line), ""]


def _warnings(evidence: Evidence) -> list[str]:
    found = facts.warnings(evidence)
    if not found:
        return []
    return ["## Warnings", "", *[f"- {inline_text(w)}" for w in found], ""]


def _claims(evidence: Evidence) -> list[str]:
    if not evidence.claims:
        return ["## Claims", "", "The manifest makes no performance claims.", ""]
    lines = [
        "## Claims",
        "",
        "| claim | where | hardware | claimed | measured | 95% CI | status | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in facts.claim_rows(evidence):
        cells = [row.metric, row.where, row.hardware, row.claimed, row.measured, row.ci95]
        cells += [CLAIM_STATUS_WORDS[row.status], row.reason]
        lines.append("| " + " | ".join(inline_text(c) for c in cells) + " |")
    return [*lines, ""]


def _correctness(evidence: Evidence) -> list[str]:
    summary = facts.correctness_summary(evidence)
    lines = [
        "## Correctness",
        "",
        f"{summary.passed} of {summary.cases} in-scope cases passed, {summary.failed} failed; "
        f"guard right on {summary.probes_passed} of {summary.probes} out-of-scope probes.",
        f"Held to: {summary.standard}.",
    ]
    if summary.replay_checks is not None:
        lines.append(summary.replay_checks)
    if summary.worst_case is not None:
        lines.append(
            f"Worst error ratio (candidate error / stock error vs the float64 reference): "
            f"{facts.fmt(summary.worst_ratio, 3)} at `{inline_text(summary.worst_case)}`."
        )
    failing = [c for c in evidence.cases if c.reasons] + [p for p in evidence.probes if p.reasons]
    items = [
        f"- `{inline_text(i.id)}` ({i.origin}): {inline_text('; '.join(i.reasons))}"
        for i in failing
    ]
    return [*lines, "", *_capped(items, "failing cases or probes"), *([""] if items else [])]


def _cases(evidence: Evidence) -> list[str]:
    if not evidence.cases:
        return []
    shown = _cases_to_show(evidence.cases)
    lines = ["## Cases", ""]
    if len(shown) < len(evidence.cases):
        lines += [
            f"Summarized: {len(shown)} of {len(evidence.cases)} cases shown (failing cases "
            "first, then an even sample); the HTML report and evidence.json list every case.",
            "",
        ]
    lines += [
        "| case | origin | correctness | worst error ratio | stock µs | candidate µs "
        "| speedup (95% CI) | kernels stock / candidate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return [*lines, *[_case_row(case) for case in shown], ""]


def _cases_to_show(cases: list[CaseEvidence]) -> list[CaseEvidence]:
    """Every case if they fit; else the failing ones, then an even sample of the rest."""
    if len(cases) <= MAX_CASE_ROWS:
        return cases
    failing = [c for c in cases if c.status != "passed"][:MAX_CASE_ROWS]
    others = [c for c in cases if c.status == "passed"]
    # from the first case to the last: a step of len // room kept the first `room` cases only
    # whenever there were fewer than twice as many (72 cases: batch 1-16 of 1-64)
    return failing + facts.even_sample(others, MAX_CASE_ROWS - len(failing))


def _case_row(case: CaseEvidence) -> str:
    ratio = _fixed(facts.error_ratio(case), 2)
    head = f"| {inline_text(case.id)} | {case.origin} | {case.status} | {ratio}"
    perf = case.performance
    if perf is None:
        return f"{head} | - | - | - | - |"
    return (
        f"{head} | {perf.stock_us_median:.2f} | {perf.candidate_us_median:.2f} "
        f"| {facts.speedup_with_ci(perf)} "
        f"| {facts.kernel_pair(perf)} |"
    )


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kernels(evidence: Evidence) -> list[str]:
    return ["## Kernels per layer", "", facts.kernel_summary(evidence) + ".", ""]


def _coverage(evidence: Evidence) -> list[str]:
    cov = facts.coverage(evidence)
    origins = ", ".join(f"{n} {origin}" for origin, n in cov.by_origin.items()) or "none"
    lines = [
        "## Scope coverage",
        "",
        f"Run here: {len(evidence.cases)} cases ({origins}); batch {_list(cov.batches)}; "
        f"context {_list(cov.contexts) if cov.contexts else '-'}; CP {_list(cov.cp)}; "
        f"GPUs {_list(cov.gpus)}; {len(evidence.probes)} out-of-scope probes.",
        "",
    ]
    if cov.not_run:
        items = [f"- {inline_text(item)}" for item in cov.not_run]
        lines += ["Could not run on this hardware:", "", *_capped(items, "items"), ""]
    return lines


def _list(values: list[int]) -> str:
    if len(values) > 12:
        return f"{values[0]}..{values[-1]} ({len(values)} values)"
    return ", ".join(str(v) for v in values) or "-"


def _environment(evidence: Evidence, source: SourceInfo | None) -> list[str]:
    rows = [
        f"| {label} | {inline_text(value)} |"
        for label, value in facts.environment_rows(evidence, source)
    ]
    return ["## Environment", "", "| | |", "|---|---|", *rows, ""]


def _within_budget(text: str) -> str:
    """A last guard: long reasons could still push the report past GitHub's limit."""
    if len(text) <= BUDGET_CHARS:
        return text
    reproduce = text[text.rindex("## Reproduce") :]
    head = text[: BUDGET_CHARS - len(reproduce) - 200]
    head = head[: head.rfind("\n")]
    return f"{head}\n\n(truncated to stay under GitHub's limit; see the HTML report)\n\n{reproduce}"
