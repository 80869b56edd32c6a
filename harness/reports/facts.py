"""What every form of the report says, computed once from the evidence.

The Markdown, the HTML and the dashboard show the same content; this module derives it (claim
rows, the correctness summary, scope coverage, kernel counts, environment, warnings) so the forms
cannot drift apart. Everything here is a field of the evidence or a statistic of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from harness.evaluation.evidence import (
    CaseEvidence,
    ClaimEvidence,
    DecodeCheckEvidence,
    Evidence,
    PerformanceEvidence,
)
from harness.evaluation.stats import distinct_texts, with_ci
from scopes.manifest import Tolerance

# A speedup above this is possible (a fused kernel replacing a dozen launches) but rare enough
# that a maintainer should look at how it was measured before believing it.
IMPLAUSIBLE_SPEEDUP = 10.0
CLAIM_STATUS_WORDS = {
    "verified": "verified",
    "refuted": "refuted",
    "inconclusive": "inconclusive",
    "not_measurable": "not measurable here",
}
# The environment rows a reviewer needs, in order, with the evidence key they come from.
ENVIRONMENT_KEYS = (
    ("GPU", "gpu_name"),
    ("host GPU kind x count", None),
    ("driver", "driver"),
    ("CUDA", "cuda"),
    ("torch", "torch"),
    ("Triton", "triton"),
    ("CuTe DSL", "cutlass_dsl"),
    ("vLLM", "vllm"),
    ("Python", "python"),
    ("harness", "harness_version"),
    ("harness SHA", "harness_sha"),
    ("fingerprint", "fingerprint_hash"),
)
# Shown where the run recorded them (the GPU's own details exist on CUDA hosts only).
ENVIRONMENT_DETAIL_KEYS = (
    ("compute capability", "compute_capability"),
    ("SMs", "sm_count"),
    ("GPU memory (bytes)", "gpu_memory_bytes"),
    ("L2 cache (bytes)", "l2_cache_bytes"),
    ("SM clock at start", "sm_clock"),
    ("SM clock max", "sm_clock_max"),
    ("memory clock at start", "mem_clock"),
    ("power limit", "power_limit"),
    ("NumPy", "numpy"),
    ("platform", "platform"),
)

T = TypeVar("T")


@dataclass(frozen=True)
class SourceInfo:
    """Where the candidate came from (the submission's source; evidence alone does not say)."""

    kind: str  # in_tree | git
    url: str | None = None
    sha: str | None = None


@dataclass(frozen=True)
class ClaimRow:
    description: str
    metric: str
    where: str
    hardware: str
    claimed: str
    measured: str
    ci95: str
    status: str  # the evidence's status key: verified / refuted / inconclusive / not_measurable
    status_words: str
    reason: str


@dataclass(frozen=True)
class CorrectnessSummary:
    cases: int
    passed: int
    failed: int  # any status but passed
    worst_ratio: float | None
    worst_case: str | None
    probes: int
    probes_passed: int
    standard: str  # what the candidate was held to, from the manifest the run used
    replay_checks: str | None  # what the timed replays were checked for; None: before the check


@dataclass(frozen=True)
class Coverage:
    batches: list[int]
    contexts: list[int]
    cp: list[int]
    gpus: list[int]
    by_origin: dict[str, int]
    not_run: list[str]


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def speedup_with_ci(performance: PerformanceEvidence) -> str:
    return with_ci(performance.speedup, performance.speedup_ci95, 3, "f", marks=(1.0,))


def claim_rows(evidence: Evidence) -> list[ClaimRow]:
    return [_claim_row(claim) for claim in evidence.claims]


def _claim_row(claim: ClaimEvidence) -> ClaimRow:
    spec = claim.claim
    where = ", ".join(f"{k}={v}" for k, v in (spec.get("where") or {}).items()) or "all cases"
    marks: tuple[float, ...] = ()
    if spec.get("at_least") is not None:
        claimed, marks = f">= {spec['at_least']:g}", (spec["at_least"],)
    elif spec.get("at_most") is not None:
        claimed, marks = f"<= {spec['at_most']:g}", (spec["at_most"],)
    else:
        claimed = "-"
    measured, ci = fmt(claim.measured), "-"
    if claim.measured is not None and claim.ci95:
        measured, low, high = distinct_texts((claim.measured, *claim.ci95, *marks))[:3]
        ci = f"[{low}, {high}]"
    return ClaimRow(
        description=claim.description,
        metric=str(spec.get("metric", "?")),
        where=where,
        hardware=str(spec.get("hardware") or "any"),
        claimed=claimed,
        measured=measured,
        ci95=ci,
        status=claim.status,
        status_words=CLAIM_STATUS_WORDS[claim.status],
        reason=claim.reason,
    )


def correctness_summary(evidence: Evidence) -> CorrectnessSummary:
    checked = [c for c in evidence.cases if error_ratio(c) is not None]
    worst = max(checked, key=lambda c: error_ratio(c) or 0.0, default=None)
    return CorrectnessSummary(
        cases=len(evidence.cases),
        passed=sum(c.status == "passed" for c in evidence.cases),
        failed=sum(c.status != "passed" for c in evidence.cases),
        worst_ratio=error_ratio(worst) if worst else None,
        worst_case=worst.id if worst else None,
        probes=len(evidence.probes),
        probes_passed=sum(p.status == "passed" for p in evidence.probes),
        standard=correctness_standard(evidence.manifest),
        replay_checks=replay_checks(evidence),
    )


def replay_checks(evidence: Evidence) -> str | None:
    """What was checked of the candidate's timed replays as they ran, over all cases, in a
    sentence; None in evidence from before those checks."""
    timed = [c.performance for c in evidence.cases if c.performance]
    compared = [p.watched_replays for p in timed if p.watched_replays is not None]
    tallied = [p.tallied_replays for p in timed if p.tallied_replays is not None]
    input_sets = [p.timed_input_sets for p in timed if p.timed_input_sets is not None]
    if not compared:
        return None
    if not tallied and not input_sets:  # evidence of 2026-12-06, before every replay was tallied
        return (
            f"{sum(compared)} timed replays of the candidate were compared with its eager "
            "result as they ran."
        )
    tolerance = Tolerance.model_validate(evidence.manifest.get("tolerance") or {})
    what = (
        "the same bits as its eager result"
        if tolerance.deterministic
        else "written, finite, and as close to its eager result as the cosine floor demands"
    )
    if input_sets:
        return (
            f"All {sum(compared)} timed replays of the candidate were checked ({what} on the "
            f"same inputs); each timed pair ran on inputs of its own ({sum(input_sets)} sets), "
            "each drawn afresh, so no timed call met inputs seen before."
        )
    return (  # evidence of 2026-12-07, before the timed pairs' own inputs
        f"All {sum(tallied)} timed replays of the candidate were checked as they ran ({what}); "
        f"{sum(compared)} of them, one per batch, were compared in full with its eager result."
    )


def correctness_standard(manifest: dict[str, Any]) -> str:
    """The scope's tolerance in words: the submitter sets it, so the reader must see it (a
    looser one than the harness's defaults also sends the verdict to a reviewer)."""
    tolerance = Tolerance.model_validate(manifest.get("tolerance") or {})
    floor = f"{tolerance.abs_floor:g}" if tolerance.abs_floor is not None else "eps/8 of its dtype"
    return (
        f"error at most {tolerance.error_budget:g}x the stock path's (relative floor {floor}), "
        f"cosine at least {tolerance.min_cosine:g}, "
        + ("the same result twice" if tolerance.deterministic else "non-deterministic declared")
    )


def even_sample(items: list[T], count: int) -> list[T]:
    """`count` of the items, evenly spaced from the first to the last, in order."""
    if len(items) <= count:
        return items
    if count <= 1:
        return items[:count]
    picks = {round(i * (len(items) - 1) / (count - 1)) for i in range(count)}
    return [items[i] for i in sorted(picks)]


def error_ratio(case: CaseEvidence) -> float | None:
    """The case's worst error ratio; None where nothing was compared (a crashed case keeps a
    correctness record without trials, whose ratio of 0 means nothing)."""
    correctness = case.correctness
    return correctness.worst_error_ratio if correctness and correctness.trials else None


def coverage(evidence: Evidence) -> Coverage:
    cases = evidence.cases
    origins: dict[str, int] = {}
    for case in cases:
        origins[case.origin] = origins.get(case.origin, 0) + 1
    return Coverage(
        batches=sorted({c.batch for c in cases}),
        contexts=sorted({c.context for c in cases if c.context is not None}),
        cp=sorted({c.cp for c in cases}),
        gpus=sorted({c.gpus for c in cases}),
        by_origin=origins,
        not_run=list(evidence.not_run),
    )


def kernel_counts(evidence: Evidence) -> list[tuple[str, float | None, float | None]]:
    """(case id, stock kernels per layer, candidate kernels per layer) for timed cases."""
    return [
        (c.id, c.performance.stock_kernels_per_layer, c.performance.candidate_kernels_per_layer)
        for c in evidence.cases
        if c.performance is not None
    ]


def kernel_summary(evidence: Evidence) -> str:
    counts = kernel_counts(evidence)
    stock = sorted({s for _, s, _ in counts if s is not None})
    candidate = sorted({k for _, _, k in counts if k is not None})
    if not stock and not candidate:
        return "no kernel counts (no case was timed)"
    unit = "kernels per layer"
    if any(counts_ops(c.performance) for c in evidence.cases):
        unit = "torch ops per layer (counted on the CPU: not GPU kernels)"
    return f"stock {_span(stock)}, candidate {_span(candidate)} {unit}"


def kernel_pair(performance: PerformanceEvidence) -> str:
    """A case's "stock / candidate" kernels per layer; "ops" where the CPU profile counted
    top-level torch ops, which are not kernels and must not read as if they were."""
    stock, candidate = performance.stock_kernels_per_layer, performance.candidate_kernels_per_layer
    if stock is None or candidate is None:
        return "-"
    return f"{stock:g} / {candidate:g}" + (" ops" if counts_ops(performance) else "")


def counts_ops(performance: PerformanceEvidence | None) -> bool:
    return performance is not None and performance.kernel_source == "cpu-ops"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    if values[0] == values[-1]:
        return f"{values[0]:g}"
    return f"{values[0]:g}-{values[-1]:g}"


def environment_rows(evidence: Evidence, source: SourceInfo | None) -> list[tuple[str, str]]:
    env = evidence.environment
    rows = []
    for label, key in ENVIRONMENT_KEYS:
        if key is None:
            value: Any = f"{env.get('host_gpu')} x {env.get('host_gpu_count')}"
        else:
            value = env.get(key)
        text = "-" if value is None else str(value)
        if key == "harness_sha" and text.endswith("-dirty"):  # this commit alone is not the code
            text += " (uncommitted changes; the code digest below pins the code that ran)"
        rows.append((label, text))
    rows += [(label, str(env[key])) for label, key in ENVIRONMENT_DETAIL_KEYS if key in env]
    named = {key for _, key in ENVIRONMENT_KEYS + ENVIRONMENT_DETAIL_KEYS} | {
        "host_gpu",
        "host_gpu_count",
    }
    rows += [(key, str(env[key])) for key in sorted(env) if key not in named]  # nothing hidden
    if source is not None and source.kind == "git":
        rows.append(("candidate source", f"{source.url} at {source.sha}"))
    elif source is not None:
        rows.append(("candidate source", "in-tree (this pathgate checkout)"))
    rows += [("code digest", evidence.run.code_digest or "-")]
    rows += [("run seed", str(evidence.run.seed)), ("device", evidence.run.device)]
    rows += [("started", evidence.run.started_at), ("finished", evidence.run.finished_at)]
    return rows


def warnings(evidence: Evidence) -> list[str]:
    """What a reviewer should double-check before trusting the numbers."""
    found: list[str] = []
    timed = [c for c in evidence.cases if c.performance is not None]
    if any(not c.performance.is_gpu_evidence for c in timed if c.performance):
        found.append("CPU timings: host-clock times of eager calls, not GPU evidence.")
    fast = [c for c in timed if c.performance and c.performance.speedup > IMPLAUSIBLE_SPEEDUP]
    if fast:
        top = max(fast, key=lambda c: c.performance.speedup if c.performance else 0.0)
        speedup = top.performance.speedup if top.performance else 0.0
        found.append(
            f"implausible speedup: {len(fast)} case(s) above {IMPLAUSIBLE_SPEEDUP:g}x "
            f"(largest {speedup:.3g}x at {top.id}); check the stock path is the real baseline."
        )
    found += _hbm_warnings(timed)
    found += _late_start_warnings(timed)
    found += evidence.warnings  # the run's own: the pre-screen's findings, a floor fallback
    cached = [c for c in timed if c.performance and not c.performance.exceeds_l2]
    if cached and timed and cached[0].performance and cached[0].performance.is_gpu_evidence:
        found.append(
            f"{len(cached)} of {len(timed)} timed case(s) have a working set that fits in L2: "
            "their layers may be served from cache rather than HBM."
        )
    return found


def _late_start_warnings(timed: list[CaseEvidence]) -> list[str]:
    """Batches timed again because a call's interval may have held the host's launch of the
    graph (timing.sample_interleaved), and sampled calls for which that may still be so: such a
    time is too high, and more so for the path with the larger graph (usually the stock, which
    flatters the speedup)."""
    found = []
    retimed = [c for c in timed if c.performance and c.performance.late_batches]
    if retimed:
        batches = sum(c.performance.late_batches or 0 for c in retimed if c.performance)
        longest = max((c.performance.lead_cycles or 0) if c.performance else 0 for c in retimed)
        found.append(
            f"re-timed batches: {batches} batch(es) of pairs in {len(retimed)} case(s) had a "
            "call that may have started before the host had queued it; they were not sampled, "
            f"and the GPU's spin before each timed call grew (to {longest:,} cycles at most): "
            "the host fell behind the GPU at times."
        )
    late = [c for c in timed if c.performance and c.performance.late_starts]
    if late:
        calls = sum(c.performance.late_starts or 0 for c in late if c.performance)
        total = sum(c.performance.timed_calls or 0 for c in late if c.performance)
        worst = max(late, key=lambda c: (c.performance.late_starts or 0) if c.performance else 0)
        found.append(
            f"late starts: {calls} of the {total} timed calls of {len(late)} case(s) may have "
            f"started before the host had queued them (most at {worst.id}), even after the "
            "GPU's spin before each call had reached its longest, so their times may include "
            "the graph's launch: the host fell behind the GPU; rerun on a quieter host."
        )
    return found


def _hbm_warnings(timed: list[CaseEvidence]) -> list[str]:
    beyond = [
        c
        for c in timed
        if c.performance
        and c.performance.candidate_hbm_fraction is not None
        and c.performance.candidate_hbm_fraction > 1.0
    ]
    if not beyond:
        return []
    ids = ", ".join(c.id for c in beyond[:5])
    return [
        f"beyond the HBM floor: the candidate moved its bytes faster than the measured HBM "
        f"bandwidth in {len(beyond)} case(s) ({ids}); the timing or the byte count is wrong."
    ]


def decode_check_line(evidence: Evidence) -> str | None:
    """The model-level decode check in one sentence, or None when the run has none."""
    check = evidence.decode_check
    if check is None:
        return None
    if check.status == "not_run":
        return f"not run: {'; '.join(check.reasons)}"
    shape = (
        f"{check.layers} layers, {check.steps} steps, {check.prompts} prompts, vocab {check.vocab}"
    )
    if check.status == "crashed" or check.token_match is None or check.mean_kl is None:
        return f"{check.status} ({shape}): {'; '.join(check.reasons)}"
    diverged = [s for s in check.first_divergence if s is not None]
    divergence = f"first divergence at step {min(diverged)}" if diverged else "no divergence"
    return (
        f"{check.status} ({shape}; {check.case}): greedy tokens agree at "
        f"{check.token_match:.1%} of steps (at least {check.min_token_match:.1%}), {divergence}; "
        f"mean KL(stock || candidate) {_kl(check.mean_kl)} nats (at most {check.max_mean_kl:g}), "
        f"max {_kl(check.max_kl)}" + _distance_from_reference(check)
    )


def _kl(value: float | None) -> str:
    """A KL divergence; below 1e-6 nats the float sums' rounding decides its sign and digits
    (identical distributions read -1.18e-09), so it prints as that bound."""
    if value is None:
        return "-"
    return "< 1e-06" if abs(value) < 1e-6 else f"{value:.3g}"


def _distance_from_reference(check: DecodeCheckEvidence) -> str:
    stock, candidate = check.stock_kl_from_reference, check.candidate_kl_from_reference
    if stock is None or candidate is None:  # evidence from before the reference was added
        return ""
    return (
        f"; from the float64 reference model: stock {stock:.3g}, candidate {candidate:.3g} nats "
        f"(at most {check.kl_budget:g}x the stock's when the KL is above its bound)"
    )
