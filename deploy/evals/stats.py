"""Confidence bounds for a paired difference of two proportions, and the power of the gate's rule.

Two runs answer the same n questions. With b10 the questions the baseline got right and this run
wrong, and b01 the reverse, the drop in accuracy is (b10 - b01) / n. Only the discordant questions
carry information, which is why a paired bound is far tighter than one that treats the two runs as
independent samples (the gsm8k outcomes of two runs of one model agree on ~98 % of questions).

- `tango_interval`: the asymptotic score interval of Tango (1998), "Equivalence test and confidence
  interval for the difference in proportions for the paired-sample design", Statistics in Medicine
  17:891-908 (recommended by Fagerland, Lydersen & Laake 2014, Stat Methods Med Res 23:6).
- `newcombe_interval`: Newcombe's method 10 (1998), "Improved confidence intervals for the difference
  between binomial proportions based on paired data", Statistics in Medicine 17:2635-2650: Wilson
  score limits of each proportion, combined with the phi correlation of the 2x2 table.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal

__all__ = ["Interval", "newcombe_interval", "paired_interval", "paired_power", "tango_interval", "wilson"]

Interval = Literal["tango", "newcombe"]


def _check(b10: int, b01: int, n: int) -> None:
    if n < 1 or b10 < 0 or b01 < 0 or b10 + b01 > n:
        raise ValueError(f"need 0 <= b10, b01 and b10 + b01 <= n >= 1, not b10={b10}, b01={b01}, n={n}")


def _tango_z(delta: float, b10: int, b01: int, n: int) -> float:
    """Tango's score statistic at a hypothesised difference `delta` (decreasing in delta)."""
    # Restricted MLE of p01 given p10 - p01 = delta: the positive root of 2n q^2 + w q - b01 delta (1 - delta) = 0.
    w = -b10 - b01 + (2 * n - b10 + b01) * delta
    q = (math.sqrt(max(w * w + 8.0 * n * b01 * delta * (1.0 - delta), 0.0)) - w) / (4.0 * n)
    variance = n * (2.0 * q + delta * (1.0 - delta))
    numerator = b10 - b01 - n * delta
    if variance <= 0.0:
        return math.inf if numerator > 0 else (-math.inf if numerator < 0 else 0.0)
    return numerator / math.sqrt(variance)


def _bisect(f_positive_below: float, lo: float, hi: float, b10: int, b01: int, n: int, z: float) -> float:
    """The delta in [lo, hi] where `_tango_z(delta) == f_positive_below`, by bisection (z is monotone)."""
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _tango_z(mid, b10, b01, n) > f_positive_below:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def tango_interval(b10: int, b01: int, n: int, z: float) -> tuple[float, float]:
    """Two-sided score interval for (b10 - b01) / n at normal quantile `z` (1.645 for a one-sided 95 % bound)."""
    _check(b10, b01, n)
    estimate = (b10 - b01) / n
    lower = -1.0 if _tango_z(-1.0 + 1e-12, b10, b01, n) <= z else _bisect(z, -1.0 + 1e-12, estimate, b10, b01, n, z)
    upper = 1.0 if _tango_z(1.0 - 1e-12, b10, b01, n) >= -z else _bisect(-z, estimate, 1.0 - 1e-12, b10, b01, n, z)
    return lower, upper


def wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of one proportion."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(b10: int, b01: int, n: int, z: float, *, both: int | None = None) -> tuple[float, float]:
    """Newcombe's method 10 for p1 - p2, p1 the baseline's accuracy ((both + b10) / n) and p2 this run's.

    `both` (questions both runs got right) enters through p1, p2 and phi; when omitted it is taken as
    n - b10 - b01 (no question wrong in both runs), which only matters for phi."""
    _check(b10, b01, n)
    a = n - b10 - b01 if both is None else both
    d = n - a - b10 - b01
    if a < 0 or d < 0:
        raise ValueError(f"both={both} does not fit n={n}, b10={b10}, b01={b01}")
    p1, p2 = (a + b10) / n, (a + b01) / n
    l1, u1 = wilson(a + b10, n, z)
    l2, u2 = wilson(a + b01, n, z)
    denominator = (a + b10) * (b01 + d) * (a + b01) * (b10 + d)
    phi = (a * d - b10 * b01) / math.sqrt(denominator) if denominator > 0 else 0.0
    estimate = p1 - p2
    lower = estimate - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    upper = estimate + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return max(-1.0, lower), min(1.0, upper)


def paired_interval(
    b10: int, b01: int, n: int, *, confidence: float, method: Interval = "tango", both: int | None = None
) -> tuple[float, float]:
    """Two-sided interval whose upper end is a one-sided `confidence` upper bound of the drop."""
    z = NormalDist().inv_cdf(confidence)
    if method == "tango":
        return tango_interval(b10, b01, n, z)
    if method == "newcombe":
        return newcombe_interval(b10, b01, n, z, both=both)
    raise ValueError(f"unknown interval {method!r}; use 'tango' or 'newcombe'")


def paired_power(n: int, flip_rate: float, drop: float, max_drop: float, confidence: float) -> float:
    """Approximate chance that the rule fails a run whose true drop is `drop`.

    The run is modelled as losing `flip_rate + drop` of the questions and gaining `flip_rate` (so
    `flip_rate` is the run-to-run churn in each direction); the rule fails when the upper bound,
    about d + z * sd, reaches `max_drop`. A normal approximation; scripts/simulate_gate.py measures it."""
    if n < 1:
        return 0.0
    z = NormalDist().inv_cdf(confidence)
    p10, p01 = min(flip_rate + drop, 1.0), min(flip_rate, 1.0)
    sd = math.sqrt(max(p10 + p01 - (p10 - p01) ** 2, 1.0 / n) / n)
    return 1.0 - NormalDist().cdf((max_drop - z * sd - (p10 - p01)) / sd)
