"""Bootstrap intervals: cover the truth for equal arms, exclude 1.0 for a clear difference."""

from __future__ import annotations

import numpy as np

from harness.evaluation.stats import median_ci95, speedup_ci95


def test_equal_arms_interval_contains_one() -> None:
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(40):
        stock = list(10.0 + rng.normal(0, 0.2, 200))
        candidate = list(10.0 + rng.normal(0, 0.2, 200))
        _, low, high = speedup_ci95(stock, candidate)
        covered += low <= 1.0 <= high
    assert covered >= 36


def test_a_four_percent_slowdown_is_detected() -> None:
    rng = np.random.default_rng(1)
    stock = list(10.0 + rng.normal(0, 0.1, 200))
    candidate = list(10.4 + rng.normal(0, 0.1, 200))
    point, _, high = speedup_ci95(stock, candidate)
    assert high < 1.0
    assert abs(point - 10.0 / 10.4) < 0.01


def test_median_ci_brackets_the_median() -> None:
    samples = [float(v) for v in range(1, 102)]
    median, low, high = median_ci95(samples)
    assert median == 51.0
    assert low < 51.0 < high
