"""The statistics of a study: mean and standard deviation over seeds, and the difference of a row from the
baseline paired by seed with a Student-t 95% interval; and a curve read between its points (:func:`interpolate`,
for the validation curves and the training clock).

Everything is plain Python (``math`` only): the Student-t quantile is found by bisection on its CDF,
which is integrated numerically from the density, so no SciPy is needed. The tests hold it to published
table values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Sequence


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("values must not be empty")
    return sum(values) / len(values)


def sample_std(values: Sequence[float]) -> float | None:
    """The standard deviation with ``n - 1`` in the denominator; ``None`` for fewer than two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _t_density(x: float, df: int) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """``P(T <= x)`` for Student's t with ``df`` degrees of freedom (Simpson's rule on the density; the
    substitution ``x = tan(u)`` keeps the heavy tails of small ``df`` accurate)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    upper = math.atan(x)
    n = 400  # even; the integrand is smooth on [0, atan(x)]
    h = upper / n
    total = 0.0
    for i in range(n + 1):
        u = i * h
        w = 1 if i in (0, n) else (4 if i % 2 else 2)
        total += w * _t_density(math.tan(u), df) / math.cos(u) ** 2
    return 0.5 + total * h / 3


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Summary:
    """A row's metric over its seeds."""

    mean: float
    std: float | None  # None with one seed
    n: int
    values: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    return Summary(mean(values), sample_std(values), len(values), list(values))


@dataclass
class PairedDifference:
    """``row - baseline`` paired by seed: the mean difference, its 95% interval and what it says."""

    mean: float
    std: float | None
    n: int
    low: float | None  # the 95% interval; None with fewer than two pairs
    high: float | None
    seeds: list[int]

    @property
    def significant(self) -> bool | None:
        """True when the interval excludes zero; None when there is no interval."""
        if self.low is None:
            return None
        return self.low > 0 or self.high < 0

    def verdict(self, lower_is_better: bool, than: str = "the baseline") -> str:
        """What the interval shows: better or worse than ``than`` (the row subtracted), or no difference; from
        fewer than :data:`FEW_SEEDS` pairs it says so (:func:`seeds_note`)."""
        if self.significant is None:
            return "too few seeds for an interval"
        if not self.significant:
            return "no significant difference" + seeds_note(self.n)
        return self.direction(lower_is_better, than) + seeds_note(self.n)

    def direction(self, lower_is_better: bool, than: str = "the baseline") -> str:
        """``better than`` or ``worse than`` ``than`` by the sign of the mean alone (the interval not read)."""
        better = (self.mean < 0) == lower_is_better
        return f"better than {than}" if better else f"worse than {than}"

    def to_dict(self) -> dict:
        return {**asdict(self), "significant": self.significant}


#: A verdict from fewer seeds than this says so: with two seeds the Student-t interval rests on one degree of
#: freedom (its quantile is 12.7), and its standard deviation is a single difference of two values.
FEW_SEEDS = 3


def seeds_note(n: int) -> str:
    """What a verdict from ``n`` paired seeds adds: nothing from :data:`FEW_SEEDS` on, else the count."""
    return "" if n >= FEW_SEEDS else f" ({n} seed{'s' if n != 1 else ''}: fewer than {FEW_SEEDS})"


#: Where an equal-time difference is read: at the step-time ratio's median and at the two ends of its 95% interval.
RATIO_READINGS = ("the median ratio", "the ratio's low end", "the ratio's high end")
NOT_DECIDED = "not decided at equal time"


def equal_time_verdict(at_median: PairedDifference, at_ends: Sequence[PairedDifference | None] | None,
                       lower_is_better: bool = True, than: str = "the baseline") -> str:
    """The verdict of an equal-time difference, which depends on the step-time ratio it is read at: "better" or
    "worse" than ``than`` only when the 95% interval excludes 0 with the same sign read at the ratio's median
    (``at_median``) and at both ends of the ratio's 95% interval (``at_ends``, low then high); otherwise
    ``"not decided at equal time: REASON"`` (the ratio has no interval, a reading falls before a validation, the
    sign of Δ changes within the ratio's interval, or the interval includes 0 at one of the readings). Fewer than
    :data:`FEW_SEEDS` pairs: said, as in :meth:`PairedDifference.verdict`."""
    if at_median.significant is None:
        return "too few seeds for an interval"
    note = seeds_note(at_median.n)
    if at_ends is None:
        return f"{NOT_DECIDED}: the step-time ratio has no interval{note}"
    if len(at_ends) != 2:
        raise ValueError(f"at_ends must hold the readings at the ratio's two interval ends, got {len(at_ends)}")
    readings = [at_median, *at_ends]
    unread = [where for where, d in zip(RATIO_READINGS, readings) if d is None]
    if unread:
        return f"{NOT_DECIDED}: Δ cannot be read at {' and '.join(unread)} (before a validation){note}"
    means = [d.mean for d in readings]
    if min(means) < 0 < max(means):
        return (f"{NOT_DECIDED}: the sign depends on the step-time ratio (mean Δ {min(means):+.3f} to "
                f"{max(means):+.3f} within its interval){note}")
    if not at_median.significant:
        return f"{NOT_DECIDED}: no significant difference at the median ratio{note}"
    open_at = [where for where, d in zip(RATIO_READINGS[1:], at_ends) if not d.significant]
    if open_at:
        where = "both ends of the ratio's interval" if len(open_at) == 2 else open_at[0]
        return f"{NOT_DECIDED}: Δ's 95% interval includes 0 at {where}{note}"
    return at_median.direction(lower_is_better, than) + note


def paired_difference(row: dict[int, float], baseline: dict[int, float], confidence: float = 0.95) -> PairedDifference:
    """The difference ``row[seed] - baseline[seed]`` over the seeds both have, with a Student-t interval
    ``mean +- t_{(1+confidence)/2, n-1} * std / sqrt(n)``."""
    seeds = sorted(set(row) & set(baseline))
    if not seeds:
        raise ValueError("row and baseline share no seed: nothing to pair")
    diffs = [row[s] - baseline[s] for s in seeds]
    m, sd, n = mean(diffs), sample_std(diffs), len(diffs)
    if sd is None:
        return PairedDifference(m, None, n, None, None, seeds)
    half = t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
    return PairedDifference(m, sd, n, m - half, m + half, seeds)


def interpolate(xs: list[float], ys: list[float], x: float, *, clamp: bool = False) -> float | None:
    """``y`` at ``x`` on the polyline through ``(xs, ys)`` (``xs`` increasing); outside ``[xs[0], xs[-1]]``:
    the end value with ``clamp``, else ``None``."""
    if not xs:
        return None
    if x < xs[0] or x > xs[-1]:
        if not clamp:
            return None
        return ys[0] if x < xs[0] else ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]
