"""Is a change real? Per-step values of a figure on two sides, tested as users of the field test runs (Welch's t on
the per-step values, with its 95 % confidence interval of the difference of the means and Cohen's d), and the
steps that stand out of a series (a periodic hiccup: a checkpoint every tenth step).

    change(before, after, floor)  -> Change: the difference per step, its interval, and whether it is significant
    hiccups(values)               -> the indices of the steps far above the others (robust: median and MAD)

A change is *significant* when its 95 % interval excludes zero and it is larger than `floor` (what is worth an
engineer's time: a figure's practical threshold). One step on a side measures no noise: the change is then
"one step" and never called significant or within noise. Pure: no I/O."""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

CONFIDENCE = 0.95
HICCUP_MADS = 6.0  # a step this many robust deviations above the median of its series stands out ...
HICCUP_SHARE = 0.10  # ... and by at least this share of the median ...
HICCUP_MIN_MS = 5.0  # ... and this many ms
HICCUP_MOST = 1 / 3  # more than this share of steps standing out is not a hiccup but the series itself


@dataclass(frozen=True)
class Change:
    """Per step: mean before and after, their difference and its 95 % interval (None: one step on a side), and
    the verdict: grew, shrank, same (the interval holds zero or the change is below the floor), one_step, none
    (no values on a side)."""

    before: float | None
    after: float | None
    delta: float | None
    lo: float | None
    hi: float | None
    verdict: str
    n_before: int
    n_after: int
    effect: float | None = None  # Cohen's d

    @property
    def significant(self) -> bool:
        return self.verdict in ("grew", "shrank")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("before", "after", "delta", "lo", "hi", "effect"):
            if out[key] is not None:
                out[key] = round(out[key], 3)
        return out

    def text(self, unit: str = "ms/step") -> str:
        """`+48.1 ms/step (95 % CI +41.0 to +55.2)`, or `(one step: no noise estimate)`."""
        if self.delta is None:
            return "no values"
        head = f"{signed(self.delta)} {unit}"
        if self.lo is None or self.hi is None:
            return head + " (one step: no noise estimate)"
        return head + f" (95 % CI {signed(self.lo)} to {signed(self.hi)})"


def change(before: Sequence[float], after: Sequence[float], floor: float = 0.0) -> Change:
    """Welch's t-test of the per-step values `before` and `after` (module docstring)."""
    a, b = [float(x) for x in before], [float(x) for x in after]
    na, nb = len(a), len(b)
    if not na or not nb:
        return Change(_mean(a), _mean(b), None, None, None, "none", na, nb)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    delta = mb - ma
    if na < 2 or nb < 2:
        return Change(ma, mb, delta, None, None, "one_step", na, nb)
    va, vb = statistics.variance(a, ma), statistics.variance(b, mb)
    se2 = va / na + vb / nb
    if se2 <= 0:
        lo = hi = delta
    else:
        df = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1)) if va or vb else float(na + nb - 2)
        half = t_quantile(0.5 + CONFIDENCE / 2, df) * math.sqrt(se2)
        lo, hi = delta - half, delta + half
    pooled = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2)) if na + nb > 2 else 0.0
    effect = delta / pooled if pooled > 0 else None
    if abs(delta) < floor or lo <= 0 <= hi:
        verdict = "same"
    else:
        verdict = "grew" if delta > 0 else "shrank"
    return Change(ma, mb, delta, lo, hi, verdict, na, nb, effect)


def hiccups(values: Sequence[float]) -> list[int]:
    """The steps of a series far above the others (module constants): robust to the hiccups themselves (the
    median and the median absolute deviation); none where more than a third stand out (that is the series)."""
    n = len(values)
    if n < 3:
        return []
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values) * 1.4826
    bar = med + max(HICCUP_MADS * mad, HICCUP_SHARE * abs(med), HICCUP_MIN_MS)
    out = [i for i, v in enumerate(values) if v > bar]
    return out if len(out) <= HICCUP_MOST * n else []


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (df may be fractional: Welch's)."""
    if df > 200:
        return statistics.NormalDist().inv_cdf(p)
    return _t_quantile(round(p, 6), round(df, 2))


@functools.lru_cache(maxsize=4096)
def _t_quantile(p: float, df: float) -> float:
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(80):  # bisection: the cdf is monotone, and this runs once per (p, df)
        mid = (lo + hi) / 2
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _t_cdf(t: float, df: float) -> float:
    """P(T <= t) for t >= 0."""
    x = df / (df + t * t)
    return 1 - 0.5 * _betai(df / 2, 0.5, x)


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, Numerical Recipes' betacf)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1 + aa * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 3e-14:
            break
    return h


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) < 10 else f"{x:+.1f}"
