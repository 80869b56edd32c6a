"""Statistics of timing samples: medians and bootstrap 95% confidence intervals."""

from __future__ import annotations

import math

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def median(samples: list[float]) -> float:
    return float(np.median(np.asarray(samples, dtype=np.float64)))


def speedup_ci95(
    stock_us: list[float], candidate_us: list[float], seed: int = 0
) -> tuple[float, float, float]:
    """(point, low, high) of median(stock) / median(candidate).

    Samples are taken in interleaved pairs, so pairs are resampled together: a drift in clocks
    during the run moves both arms of a pair and does not widen the interval spuriously.
    """
    stock = np.asarray(stock_us, dtype=np.float64)
    candidate = np.asarray(candidate_us, dtype=np.float64)
    point = float(np.median(stock) / np.median(candidate))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(stock), size=(BOOTSTRAP_RESAMPLES, len(stock)))
    ratios = np.median(stock[picks], axis=1) / np.median(candidate[picks], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return point, float(low), float(high)


def median_ci95(samples: list[float], seed: int = 0) -> tuple[float, float, float]:
    values = np.asarray(samples, dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    medians = np.median(values[picks], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(values)), float(low), float(high)


def distinct_texts(numbers: tuple[float, ...], places: int = 4, style: str = "g") -> list[str]:
    """`numbers` printed with `places` digits (decimals for style "f", significant for "g"), or up
    to three more where rounding would print two different finite numbers alike: a speedup of
    1.0004 in [1.0001, 1.0008] must not read "1.000 [1.000, 1.001]", as if the interval touched
    the point, or 1.0 when 1.0 is among them."""
    finite = {x for x in numbers if math.isfinite(x)}
    for digits in range(places, places + 4):
        texts = [f"{x:.{digits}{style}}" for x in numbers]
        if len({f"{x:.{digits}{style}}" for x in finite}) == len(finite):
            break
    return texts


def with_ci(
    value: float,
    ci: tuple[float, float],
    places: int = 4,
    style: str = "g",
    marks: tuple[float, ...] = (),
) -> str:
    """`value [low, high]`, kept apart from each other and from `marks` (a claim's bound, 1.0)."""
    point, low, high = distinct_texts((value, *ci, *marks), places, style)[:3]
    return f"{point} [{low}, {high}]"
