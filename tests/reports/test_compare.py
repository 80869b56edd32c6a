"""The reproducibility view: two real H200 runs of one scope, case by case."""

from __future__ import annotations

from harness.reports.compare import compare_runs
from tests.reports.evidence_fixtures import load


def test_two_h200_runs_match_on_grid_cases() -> None:
    a, b = load("h200_rmsnorm"), load("h200_rmsnorm_rerun")
    comparison = compare_runs(a, b)
    grid = [c.id for c in a.cases if c.origin == "grid"]
    assert sorted(d.case_id for d in comparison.matched) == sorted(grid)
    # the random sizes come from each run's secret seed, so they differ
    assert set(comparison.only_a) == {c.id for c in a.cases if c.origin == "random"}
    assert set(comparison.only_b) == {c.id for c in b.cases if c.origin == "random"}
    for diff in comparison.matched:
        low, high = diff.diff_ci95
        assert low <= diff.diff_us <= high
        assert abs(diff.relative) < 0.1  # the same kernel on the same GPU: within 10%


def test_a_run_against_itself_differs_by_nothing() -> None:
    a = load("h200_rmsnorm")
    for diff in compare_runs(a, a).matched:
        assert diff.diff_us == 0.0 and not diff.significant


def test_a_real_slowdown_is_significant() -> None:
    a = load("h200_rmsnorm")
    slower = a.model_copy(deep=True)
    for case in slower.cases:
        assert case.performance is not None
        case.performance.candidate_us = [x * 1.2 for x in case.performance.candidate_us]
    assert all(d.significant and d.diff_us > 0 for d in compare_runs(a, slower).matched)


def test_two_runs_of_one_setting_have_no_differences_to_warn_of() -> None:
    a = load("h200_rmsnorm")
    assert compare_runs(a, a.model_copy(deep=True)).differences == []
    # the rerun came after the claims were set from the first run's numbers
    rerun = compare_runs(a, load("h200_rmsnorm_rerun"))
    assert rerun.differences == ["the manifests differ in claims"]


def test_another_manifest_gpu_or_plan_size_is_named() -> None:
    """A scope name is all two submissions need to share: one with another batch range, run
    on the CPU and --quick, was compared as if it were the same setting."""
    a = load("h200_rmsnorm")
    manifest = {**a.manifest, "workload": {**a.manifest["workload"], "batch": {"min": 1, "max": 4}}}
    b = a.model_copy(
        update={
            "manifest": manifest,
            "environment": {**a.environment, "gpu_name": "cpu"},
            "run": a.run.model_copy(update={"quick": not a.run.quick}),
        }
    )
    assert compare_runs(a, b).differences == [
        "the manifests differ in workload",
        f"the GPUs differ: {a.environment['gpu_name']} and cpu",
        "one run is --quick (fewer cases, trials and samples), the other not",
    ]
