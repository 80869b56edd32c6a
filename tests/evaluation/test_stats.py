"""Bootstrap intervals: cover the truth for equal arms, exclude 1.0 for a clear difference."""

from __future__ import annotations

import math

import numpy as np

from harness.evaluation.stats import distinct_texts, median_ci95, speedup_ci95, with_ci


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


def test_interval_texts_keep_distinct_numbers_apart() -> None:
    # At three places the point and both bounds would all read 1.000: one touching 1.0.
    assert with_ci(1.0004, (1.0001, 1.0008), 3, "f", marks=(1.0,)) == "1.0004 [1.0001, 1.0008]"
    assert with_ci(1.2346, (1.1, 1.3), 3, "f", marks=(1.0,)) == "1.235 [1.100, 1.300]"
    # Equal numbers stay equal, and infinities or NaN do not force more digits.
    assert with_ci(2.0, (2.0, 2.5)) == "2 [2, 2.5]"
    assert distinct_texts((1.5, math.inf, math.nan)) == ["1.5", "inf", "nan"]
    # A claim's bound: 0.69996 is below 0.7 and must not print as it.
    assert distinct_texts((0.69996, 0.69991, 0.70001, 0.7))[:3] == ["0.69996", "0.69991", "0.70001"]
