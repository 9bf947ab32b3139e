"""Statistics for pass/fail evaluations: Wilson intervals and paired comparisons.

Champion and candidate are evaluated on the *same* tasks, so the right comparison is
paired: only the discordant tasks (one does better than the other) carry information about
which model is better. A task's score is its pass@1 estimated from its samples (passes /
samples; with one sample, pass or fail). :func:`mcnemar_exact` tests the discordant tasks
with the exact binomial (sign) test — McNemar's test when every task has one sample — and
:func:`paired_bootstrap` gives a confidence interval for the pass-rate difference by
resampling tasks. :func:`compare_paired` bundles both for the promotion gate.

The sign test ignores how *much* better a discordant task is; it stays exact whatever the
number of samples, which a gate deciding on a few dozen tasks needs more than power.
Live success rates of two model versions are independent samples, not pairs:
:func:`newcombe_interval` gives the interval of their difference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``k / n``.

    Unlike the normal ("Wald") interval it stays inside [0, 1] and behaves at 0 % and 100 %,
    which are common pass rates on small task sets (and where a freshly drifted loop's live
    success rate sits: the dashboard draws every rate with it). ``n == 0`` gives the
    vacuous (0, 1).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    return proportion_interval(k, n, confidence)


def proportion_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's interval at ``successes / n``, where ``successes`` may be a sum of per-task
    pass@1 estimates (then it is :func:`mean_interval`'s); ``n == 0`` gives (0, 1)."""
    if n < 0 or not 0.0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    z = _z(confidence)
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    # At 0 % and 100 % the bound is exactly 0 or 1; the float arithmetic leaves ~1e-17.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Interval for the mean of per-task scores in [0, 1] (pass@1 estimates).

    The Wilson interval at the mean with n = tasks. A variable in [0, 1] with mean p has a
    variance of at most p(1 - p), so this is the binomial interval when every task has one
    sample and conservative when tasks average several samples.
    """
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError("task scores must be in [0, 1]")
    return proportion_interval(min(float(sum(values)), len(values)), len(values), confidence)


def newcombe_interval(
    k_before: int, n_before: int, k_after: int, n_after: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Interval of ``k_after/n_after - k_before/n_before`` for two independent proportions.

    Newcombe's hybrid score interval (his method 10): it combines the two Wilson intervals,
    so it behaves at 0 % and 100 % as they do. Either side empty gives the vacuous (-1, 1).
    """
    if n_before == 0 or n_after == 0:
        return -1.0, 1.0
    p1, p2 = k_before / n_before, k_after / n_after
    l1, u1 = wilson_interval(k_before, n_before, confidence)
    l2, u2 = wilson_interval(k_after, n_after, confidence)
    delta = p2 - p1
    low = delta - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    high = delta + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return max(-1.0, low), min(1.0, high)


def _binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2), exactly (integer arithmetic, then one division)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs.

    Under "no difference" each discordant task is equally likely to favour either model,
    so min(b, c) ~ Binomial(b + c, 1/2); the p-value doubles the smaller tail, capped at 1.
    """
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * _binom_cdf_half(min(b, c), n))


def mcnemar_exact_one_sided(b: int, c: int) -> float:
    """One-sided exact p-value that the model winning ``c`` tasks is better: P(X >= c)."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    return 1.0 - _binom_cdf_half(c - 1, n) if c > 0 else 1.0


def paired_bootstrap(
    champion: Sequence[float],
    candidate: Sequence[float],
    *,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(delta, low, high): candidate minus champion pass rate and its percentile interval.

    Tasks are resampled with replacement, keeping each task's pair together.
    """
    _check_pairs(champion, candidate)
    _z(confidence)
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    n = len(champion)
    diffs = [float(c) - float(a) for a, c in zip(champion, candidate, strict=True)]
    delta = sum(diffs) / n
    rng = random.Random(seed)
    stats = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(n_resamples))
    alpha = (1.0 - confidence) / 2.0
    low = stats[max(0, math.floor(alpha * n_resamples))]
    high = stats[min(n_resamples - 1, math.ceil((1.0 - alpha) * n_resamples) - 1)]
    return delta, low, high


@dataclass(frozen=True)
class PairedComparison:
    """Champion vs candidate on the same tasks: rates, discordant counts, tests, interval.

    With one sample per task the counts are McNemar's table; with several, a task is
    discordant when its pass@1 estimates differ, and "passed" counts are sums of pass@1.
    """

    n: int
    champion_passed: float
    candidate_passed: float
    champion_rate: float
    candidate_rate: float
    delta: float  # candidate_rate - champion_rate
    delta_points: float  # the same, in percentage points
    both_passed: int  # ties at pass@1 = 1
    neither_passed: int  # ties at pass@1 = 0
    only_champion: int  # b: the champion did better on the task (regressions)
    only_candidate: int  # c: the candidate did better on the task (improvements)
    p_value: float  # exact McNemar, two-sided
    p_value_improvement: float  # exact, one-sided: candidate better
    p_value_loss: float  # exact, one-sided: champion better (a regression)
    ci_low: float  # paired bootstrap interval of delta
    ci_high: float
    confidence: float

    @property
    def discordant(self) -> int:
        return self.only_champion + self.only_candidate

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "discordant": self.discordant}


def compare_paired(
    champion: Sequence[float],
    candidate: Sequence[float],
    *,
    confidence: float = 0.95,
    seed: int = 0,
    n_resamples: int = 2000,
) -> PairedComparison:
    """Compare two models' per-task scores (pass/fail or pass@1) on the same tasks."""
    _check_pairs(champion, candidate)
    pairs = [(float(a), float(c)) for a, c in zip(champion, candidate, strict=True)]
    if any(not (0.0 <= a <= 1.0 and 0.0 <= c <= 1.0) for a, c in pairs):
        raise ValueError("task scores must be in [0, 1]")
    n = len(pairs)
    both = sum(a == c == 1.0 for a, c in pairs)
    neither = sum(a == c == 0.0 for a, c in pairs)
    only_champion = sum(a > c for a, c in pairs)
    only_candidate = sum(c > a for a, c in pairs)
    delta, low, high = paired_bootstrap(
        champion, candidate, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    champion_passed = sum(a for a, _ in pairs)
    candidate_passed = sum(c for _, c in pairs)
    return PairedComparison(
        n=n,
        champion_passed=champion_passed,
        candidate_passed=candidate_passed,
        champion_rate=champion_passed / n,
        candidate_rate=candidate_passed / n,
        delta=delta,
        delta_points=100.0 * delta,
        both_passed=both,
        neither_passed=neither,
        only_champion=only_champion,
        only_candidate=only_candidate,
        p_value=mcnemar_exact(only_champion, only_candidate),
        p_value_improvement=mcnemar_exact_one_sided(only_champion, only_candidate),
        p_value_loss=mcnemar_exact_one_sided(only_candidate, only_champion),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
    )


def _check_pairs(champion: Sequence[float], candidate: Sequence[float]) -> None:
    if len(champion) != len(candidate):
        raise ValueError(
            "paired comparison needs equal-length results, "
            f"got {len(champion)} and {len(candidate)}"
        )
    if not champion:
        raise ValueError("paired comparison needs at least one task")
