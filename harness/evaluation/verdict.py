"""Claims and the verdict.

A claim is checked on every measured case its `where` selects, through the 95% CI of the metric:
verified when the whole interval meets the bound (less the claim's tolerance), refuted when the
whole interval misses it, inconclusive when it straddles. A claim for other hardware, an
engine-level metric, or CPU timings is "not measurable here".

The verdict, strongest first: FAIL (a failed case, guard probe, model-level decode check or
refuted claim, or tampering),
NEEDS_REVIEW (a measurement too good to pass unread), INCONCLUSIVE (a claim not verified here),
PASS.
"""

from __future__ import annotations

from harness.evaluation.evidence import (
    CaseEvidence,
    ClaimEvidence,
    ClaimStatus,
    DecodeCheckEvidence,
    PerformanceEvidence,
    ProbeEvidence,
    Verdict,
)
from harness.evaluation.stats import distinct_texts
from scopes.manifest import SERVING_METRICS, Claim, ScopeManifest

FAILING_CASE_STATUSES = {"failed", "crashed", "unsupported", "timed_out"}
# A measured speedup above this is plausible, but too valuable to a cheat to pass unread.
REVIEW_SPEEDUP_ABOVE = 10.0


def claim_evidence(
    claim: Claim,
    status: ClaimStatus,
    reason: str,
    measured: float | None = None,
    ci95: tuple[float, float] | None = None,
    ids: list[str] | None = None,
) -> ClaimEvidence:
    """One judged claim, as evidence (layer claims here, serving claims in harness/serving)."""
    return ClaimEvidence(
        claim=claim.model_dump(exclude_defaults=True),
        description=claim.describe(),
        status=status,
        measured=measured,
        ci95=ci95,
        cases=ids or [],
        reason=reason,
    )


def check_claim(claim: Claim, cases: list[CaseEvidence], host_gpu: str) -> ClaimEvidence:
    def result(
        status: ClaimStatus,
        reason: str,
        measured: float | None = None,
        ci95: tuple[float, float] | None = None,
        ids: list[str] | None = None,
    ) -> ClaimEvidence:
        return claim_evidence(claim, status, reason, measured, ci95, ids)

    if claim.hardware and claim.hardware != host_gpu:
        return result("not_measurable", f"needs {claim.hardware}; this run was on {host_gpu}")
    if claim.metric in SERVING_METRICS:
        return result(
            "not_measurable",
            f"{claim.metric} is an engine-level metric; layer-level evidence does not measure it",
        )
    selected = [c for c in cases if _selected(claim, c) and c.performance is not None]
    if host_gpu == "cpu":
        return result("not_measurable", "CPU timings are not GPU evidence")
    if not selected:
        return result("not_measurable", "no measured case matches its `where`")
    unmeasured = _unmeasured(claim, selected)
    if unmeasured:
        return result("inconclusive", f"no measured case has {', '.join(unmeasured)}")
    per_case = [(c.id, *_metric(claim, c.performance)) for c in selected if c.performance]
    statuses = [
        (interval_status(claim, low, high), case_id, value, (low, high))
        for case_id, value, low, high in per_case
    ]
    ids = [case_id for case_id, *_ in per_case]
    for wanted in ("refuted", "inconclusive"):
        hits = [s for s in statuses if s[0] == wanted]
        if hits:
            _, case_id, value, ci = hits[0]
            point, low, high = distinct_texts((value, *ci, claim_bound(claim)))[:3]
            return result(
                wanted,
                f"{case_id}: measured {point}, 95% CI [{low}, {high}]",
                value,
                ci,
                ids,
            )
    worst = min(statuses, key=lambda s: interval_margin(claim, s[3]))
    low, high = distinct_texts((*worst[3], claim_bound(claim)))[:2]
    return result(
        "verified",
        f"all {len(statuses)} selected cases meet it; closest {worst[1]}: 95% CI [{low}, {high}]",
        worst[2],
        worst[3],
        ids,
    )


def _unmeasured(claim: Claim, selected: list[CaseEvidence]) -> list[str]:
    """The values the claim's `where` names that no selected case has (key=value)."""
    return [
        f"{key}={value}"
        for key, value in claim.where_values()
        if not any(_case_values(case)[key] == value for case in selected)
    ]


def _case_values(case: CaseEvidence) -> dict[str, int | None]:
    return {"batch": case.batch, "context": case.context, "cp": case.cp, "gpus": case.gpus}


def _selected(claim: Claim, case: CaseEvidence) -> bool:
    values = _case_values(case)
    for key, wanted in claim.where.items():
        allowed = wanted if isinstance(wanted, list) else [wanted]
        if values[key] not in allowed:
            return False
    return case.status == "passed"


def _metric(claim: Claim, perf: PerformanceEvidence) -> tuple[float, float, float]:
    """(value, ci low, ci high) of the claim's metric on one case."""
    if claim.metric == "speedup":
        return perf.speedup, *perf.speedup_ci95
    if claim.metric == "latency_us":
        return perf.candidate_us_median, *perf.candidate_us_ci95
    if claim.metric == "kernels_per_layer":
        kernels = perf.candidate_kernels_per_layer
        value = float("nan") if kernels is None else kernels
        return value, value, value
    # hbm_fraction: the fraction scales with 1 / time, so the latency CI bounds it
    fraction = perf.candidate_hbm_fraction
    if fraction is None:
        return float("nan"), float("nan"), float("nan")
    low_us, high_us = perf.candidate_us_ci95
    median_us = perf.candidate_us_median
    return fraction, fraction * median_us / high_us, fraction * median_us / low_us


def interval_status(claim: Claim, low: float, high: float) -> ClaimStatus:
    """verified / refuted / inconclusive: the whole 95% CI against the bound, less tolerance."""
    if low != low or high != high:
        return "inconclusive"
    if claim.at_least is not None:
        threshold = claim.at_least * (1 - claim.tolerance)
        return "verified" if low >= threshold else "refuted" if high < threshold else "inconclusive"
    assert claim.at_most is not None
    threshold = claim.at_most * (1 + claim.tolerance)
    return "verified" if high <= threshold else "refuted" if low > threshold else "inconclusive"


def claim_bound(claim: Claim) -> float:
    return claim.at_least if claim.at_least is not None else claim.at_most or 0.0


def interval_margin(claim: Claim, ci: tuple[float, float]) -> float:
    """How far the CI clears the bound (negative: it does not)."""
    if claim.at_least is not None:
        return ci[0] - claim.at_least
    return (claim.at_most or 0.0) - ci[1]


# The correctness standard's fields, and which way each one loosens it.
LOOSER_WHEN = {
    "tolerance": {"error_budget": "above", "min_cosine": "below", "abs_floor": "set"},
    "model_check": {"min_token_match": "below", "max_mean_kl": "above", "kl_budget": "above"},
}


def looser_standard(manifest: ScopeManifest) -> list[str]:
    """Where the scope holds the candidate to a looser correctness standard than the harness's
    defaults. The submitter writes the manifest, and an error budget of 1e9 would let any output
    pass (2026-12-06 review). A looser standard can be right (a path that trades accuracy on
    purpose), so it goes to a reviewer rather than failing. Declaring non-determinism is not
    looser: every run must still meet the budget."""
    reasons = []
    for section, rules in LOOSER_WHEN.items():
        settings = getattr(manifest, section)
        for name, way in rules.items():
            value, default = getattr(settings, name), type(settings).model_fields[name].default
            if _looser(value, default, way):
                harness_value = "own, derived from each output's dtype"
                if default is not None:
                    harness_value = f"{default:g}"
                reasons.append(
                    f"the scope sets {section}.{name} to {value:g}, looser than the harness's "
                    f"{harness_value}: a reviewer must accept that standard before this passes"
                )
    return reasons


def _looser(value: float | None, default: float | None, way: str) -> bool:
    if way == "set":
        return value is not None
    if value is None or default is None:
        return False
    return value > default if way == "above" else value < default


def review_reasons(cases: list[CaseEvidence]) -> list[str]:
    """Measurements no verdict may rest on without a reviewer: a speedup above 10x, a candidate
    faster than the HBM floor allows, a timing cross-check that disagrees. GPU evidence only."""
    reasons = []
    for case in cases:
        perf = case.performance
        if perf is None or not perf.is_gpu_evidence:
            continue
        if perf.speedup > REVIEW_SPEEDUP_ABOVE:
            reasons.append(
                f"case {case.id}: speedup {perf.speedup:.2f}x is above "
                f"{REVIEW_SPEEDUP_ABOVE:g}x; a reviewer must read the kernel before it passes"
            )
        fraction = perf.candidate_hbm_fraction
        if fraction is not None and fraction > 1.0:
            reasons.append(
                f"case {case.id}: the candidate ran at {fraction:.0%} of the HBM floor, faster "
                f"than reading the bytes the problem needs allows"
            )
        reasons += [f"case {case.id}: {flag}" for flag in perf.integrity_flags]
    return reasons


def decide(
    cases: list[CaseEvidence],
    probes: list[ProbeEvidence],
    claims: list[ClaimEvidence],
    not_run: list[str],
    tampering: list[str] | None = None,
    decode_check: DecodeCheckEvidence | None = None,
    left_out: list[str] | None = None,
    review: list[str] | None = None,
) -> tuple[Verdict, list[str]]:
    """The verdict and its reasons. `left_out`: parts of the scope this host could not run (a
    PASS would speak for them too); `review`: reasons from outside the measurements that no
    verdict may pass without a reviewer (a submission's own problem or baseline)."""
    failures = [f"tampering: {t}" for t in tampering or []]
    if decode_check is not None and decode_check.status in ("failed", "crashed"):
        failures.append(
            f"model-level decode check {decode_check.status}: {'; '.join(decode_check.reasons)}"
        )
    failures += [
        f"case {c.id}: {'; '.join(c.reasons)}" for c in cases if c.status in FAILING_CASE_STATUSES
    ]
    failures += [
        f"guard, {p.origin}: {'; '.join(p.reasons)}" for p in probes if p.status != "passed"
    ]
    failures += [
        f"claim refuted: {c.description}: {c.reason}" for c in claims if c.status == "refuted"
    ]
    if failures:
        return "FAIL", failures
    review = (review or []) + review_reasons(cases)
    if review:
        return "NEEDS_REVIEW", review
    if not cases:
        return "INCONCLUSIVE", not_run or ["no case of the scope could run here"]
    open_claims = [
        f"claim {c.status.replace('_', ' ')}: {c.description}: {c.reason}"
        for c in claims
        if c.status in ("inconclusive", "not_measurable")
    ]
    if open_claims:
        return "INCONCLUSIVE", open_claims
    if left_out:
        return "INCONCLUSIVE", [f"part of the scope did not run here: {why}" for why in left_out]
    verified = sum(c.status == "verified" for c in claims)
    return "PASS", [
        f"all {len(cases)} cases correct, guard right on all {len(probes)} probes, "
        f"{verified} of {len(claims)} claims verified"
    ]
