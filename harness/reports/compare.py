"""Two runs of one scope side by side: the reproducibility view.

For every case id present in both runs, the difference of the candidate's median latency (run B
minus run A) with a bootstrap 95% interval over the raw per-layer samples stored in both
evidences. The runs are independent, so each run's samples are resampled on their own (unlike
the paired stock/candidate samples inside one run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.evaluation.evidence import Evidence, PerformanceEvidence

BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class CaseDiff:
    case_id: str
    batch: int
    a_us: float
    b_us: float
    diff_us: float  # median(B) - median(A)
    diff_ci95: tuple[float, float]
    relative: float  # diff_us / a_us
    a_speedup: float
    b_speedup: float

    @property
    def significant(self) -> bool:
        """The interval excludes zero: the runs differ by more than their sampling noise."""
        return self.diff_ci95[0] > 0 or self.diff_ci95[1] < 0


@dataclass(frozen=True)
class Comparison:
    matched: list[CaseDiff]
    only_a: list[str]  # case ids timed in A alone (random sizes differ between seeds)
    only_b: list[str]
    # what else differs between the runs, making a case's two latencies less comparable
    differences: list[str]


def compare_runs(a: Evidence, b: Evidence, seed: int = 0) -> Comparison:
    perf_a = _timed(a)
    perf_b = _timed(b)
    rng = np.random.default_rng(seed)
    batches = {c.id: c.batch for c in a.cases}
    matched = [
        _diff(case_id, batches[case_id], perf_a[case_id], perf_b[case_id], rng)
        for case_id in perf_a
        if case_id in perf_b
    ]
    matched.sort(key=lambda d: d.batch)
    return Comparison(
        matched=matched,
        only_a=[i for i in perf_a if i not in perf_b],
        only_b=[i for i in perf_b if i not in perf_a],
        differences=run_differences(a, b),
    )


def run_differences(a: Evidence, b: Evidence) -> list[str]:
    """The manifest's fields, the GPU and the plan's size where the two runs differ. The code
    may differ: comparing two versions of a path is what this view is for."""
    differences = []
    fields = [
        name
        for name in a.manifest.keys() | b.manifest.keys()
        if a.manifest.get(name) != b.manifest.get(name)
    ]
    if fields:
        differences.append(f"the manifests differ in {', '.join(sorted(fields))}")
    gpu_a, gpu_b = (e.environment.get("gpu_name") or e.run.device for e in (a, b))
    if gpu_a != gpu_b:
        differences.append(f"the GPUs differ: {gpu_a} and {gpu_b}")
    if a.run.quick != b.run.quick:
        differences.append("one run is --quick (fewer cases, trials and samples), the other not")
    return differences


def _timed(evidence: Evidence) -> dict[str, PerformanceEvidence]:
    return {c.id: c.performance for c in evidence.cases if c.performance is not None}


def _diff(
    case_id: str,
    batch: int,
    a: PerformanceEvidence,
    b: PerformanceEvidence,
    rng: np.random.Generator,
) -> CaseDiff:
    low, high = median_diff_ci95(a.candidate_us, b.candidate_us, rng)
    diff = float(np.median(b.candidate_us) - np.median(a.candidate_us))
    a_us = float(np.median(a.candidate_us))
    return CaseDiff(
        case_id=case_id,
        batch=batch,
        a_us=a_us,
        b_us=float(np.median(b.candidate_us)),
        diff_us=diff,
        diff_ci95=(low, high),
        relative=diff / a_us if a_us else float("nan"),
        a_speedup=a.speedup,
        b_speedup=b.speedup,
    )


def median_diff_ci95(
    a_us: list[float], b_us: list[float], rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile bootstrap interval of median(b) - median(a), each resampled independently."""
    a = np.asarray(a_us, dtype=np.float64)
    b = np.asarray(b_us, dtype=np.float64)
    picks_a = rng.integers(0, len(a), size=(BOOTSTRAP_RESAMPLES, len(a)))
    picks_b = rng.integers(0, len(b), size=(BOOTSTRAP_RESAMPLES, len(b)))
    diffs = np.median(b[picks_b], axis=1) - np.median(a[picks_a], axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)
