"""Statistics for pass/fail evaluations: Wilson intervals and paired comparisons.

Champion and candidate are evaluated on the *same* tasks, so the right comparison is
paired: only the discordant tasks (one passes, the other fails) carry information about
which model is better. :func:`mcnemar_exact` tests them with the exact binomial test, and
:func:`paired_bootstrap` gives a confidence interval for the pass-rate difference by
resampling tasks. :func:`compare_paired` bundles both for the promotion gate.
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
    which are common pass rates on small task sets. ``n == 0`` gives the vacuous (0, 1).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    z = _z(confidence)
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


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
    champion: Sequence[bool],
    candidate: Sequence[bool],
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
    diffs = [int(bool(c)) - int(bool(a)) for a, c in zip(champion, candidate, strict=True)]
    delta = sum(diffs) / n
    rng = random.Random(seed)
    stats = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(n_resamples))
    alpha = (1.0 - confidence) / 2.0
    low = stats[max(0, math.floor(alpha * n_resamples))]
    high = stats[min(n_resamples - 1, math.ceil((1.0 - alpha) * n_resamples) - 1)]
    return delta, low, high


@dataclass(frozen=True)
class PairedComparison:
    """Champion vs candidate on the same tasks: rates, discordant counts, tests, interval."""

    n: int
    champion_passed: int
    candidate_passed: int
    champion_rate: float
    candidate_rate: float
    delta: float  # candidate_rate - champion_rate
    delta_points: float  # the same, in percentage points
    both_passed: int
    neither_passed: int
    only_champion: int  # b: champion passed, candidate failed (regressions)
    only_candidate: int  # c: candidate passed, champion failed (improvements)
    p_value: float  # exact McNemar, two-sided
    p_value_improvement: float  # exact, one-sided: candidate better
    ci_low: float  # paired bootstrap interval of delta
    ci_high: float
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_paired(
    champion: Sequence[bool],
    candidate: Sequence[bool],
    *,
    confidence: float = 0.95,
    seed: int = 0,
    n_resamples: int = 2000,
) -> PairedComparison:
    """Compare two models' per-task pass/fail on the same tasks (same order)."""
    _check_pairs(champion, candidate)
    pairs = [(bool(a), bool(c)) for a, c in zip(champion, candidate, strict=True)]
    n = len(pairs)
    both = sum(a and c for a, c in pairs)
    neither = sum(not a and not c for a, c in pairs)
    only_champion = sum(a and not c for a, c in pairs)
    only_candidate = sum(c and not a for a, c in pairs)
    delta, low, high = paired_bootstrap(
        champion, candidate, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    champion_passed, candidate_passed = both + only_champion, both + only_candidate
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
        ci_low=low,
        ci_high=high,
        confidence=confidence,
    )


def _check_pairs(champion: Sequence[bool], candidate: Sequence[bool]) -> None:
    if len(champion) != len(candidate):
        raise ValueError(
            "paired comparison needs equal-length results, "
            f"got {len(champion)} and {len(candidate)}"
        )
    if not champion:
        raise ValueError("paired comparison needs at least one task")
