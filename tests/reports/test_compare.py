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
