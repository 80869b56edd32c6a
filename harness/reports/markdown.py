"""The evidence report as Markdown: verdict and reasons first, then claims, cases, scope, setup."""

from __future__ import annotations

from harness.evaluation.evidence import CaseEvidence, Evidence

CLAIM_STATUS_WORDS = {
    "verified": "verified",
    "refuted": "**refuted**",
    "inconclusive": "inconclusive",
    "not_measurable": "not measurable here",
}


def render_markdown(evidence: Evidence) -> str:
    lines = [f"# pathgate: {evidence.scope}: **{evidence.verdict}**", ""]
    lines += [f"- {reason}" for reason in evidence.verdict_reasons] + [""]
    lines += [f"> {note}" for note in evidence.notes] + ([""] if evidence.notes else [])
    lines += _claims(evidence) + _cases(evidence) + _scope(evidence) + _environment(evidence)
    lines += ["## Reproduce", "", "```", evidence.run.command, "```", ""]
    return "\n".join(lines)


def _claims(evidence: Evidence) -> list[str]:
    if not evidence.claims:
        return ["## Claims", "", "The manifest makes no performance claims.", ""]
    lines = [
        "## Claims",
        "",
        "| claim | status | measured | 95% CI | why |",
        "|---|---|---|---|---|",
    ]
    for claim in evidence.claims:
        measured = f"{claim.measured:.4g}" if claim.measured is not None else "-"
        ci = f"[{claim.ci95[0]:.4g}, {claim.ci95[1]:.4g}]" if claim.ci95 else "-"
        lines.append(
            f"| {claim.description} | {CLAIM_STATUS_WORDS[claim.status]} | {measured} "
            f"| {ci} | {claim.reason} |"
        )
    return [*lines, ""]


def _cases(evidence: Evidence) -> list[str]:
    passed = sum(c.status == "passed" for c in evidence.cases)
    lines = [
        "## Cases",
        "",
        f"{passed} of {len(evidence.cases)} in-scope cases correct; "
        f"guard right on {sum(p.status == 'passed' for p in evidence.probes)} of "
        f"{len(evidence.probes)} out-of-scope probes.",
        "",
    ]
    if evidence.cases:
        lines += [
            "| case | origin | correctness | worst error ratio | stock µs | candidate µs "
            "| speedup (95% CI) | kernels stock / candidate |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_case_row(case) for case in evidence.cases]
        lines.append("")
    failing = [c for c in evidence.cases if c.reasons] + [p for p in evidence.probes if p.reasons]
    for item in failing:
        lines.append(f"- `{item.id}` ({item.origin}): {'; '.join(item.reasons)}")
    return lines + ([""] if failing else [])


def _case_row(case: CaseEvidence) -> str:
    ratio = f"{case.correctness.worst_error_ratio:.2f}" if case.correctness else "-"
    perf = case.performance
    if perf is None:
        return f"| {case.id} | {case.origin} | {case.status} | {ratio} | - | - | - | - |"
    kernels = f"{_num(perf.stock_kernels_per_layer)} / {_num(perf.candidate_kernels_per_layer)}"
    return (
        f"| {case.id} | {case.origin} | {case.status} | {ratio} | {perf.stock_us_median:.2f} "
        f"| {perf.candidate_us_median:.2f} | {perf.speedup:.3f} "
        f"[{perf.speedup_ci95[0]:.3f}, {perf.speedup_ci95[1]:.3f}] | {kernels} |"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _scope(evidence: Evidence) -> list[str]:
    if not evidence.not_run:
        return []
    return ["## Not run here", ""] + [f"- {item}" for item in evidence.not_run] + [""]


def _environment(evidence: Evidence) -> list[str]:
    env = evidence.environment
    keys = [
        "host_gpu",
        "host_gpu_count",
        "gpu_name",
        "driver",
        "cuda",
        "torch",
        "triton",
        "cutlass_dsl",
        "vllm",
        "python",
        "harness_sha",
        "fingerprint_hash",
    ]
    rows = [f"| {key} | {env.get(key)} |" for key in keys if key in env]
    return [
        "## Environment",
        "",
        "| | |",
        "|---|---|",
        *rows,
        f"| run seed | {evidence.run.seed} |",
        f"| started | {evidence.run.started_at} |",
        "",
    ]
