"""Binomial confidence intervals for pass rates and success rates.

The dashboard draws every rate with a Wilson score interval: unlike the normal
approximation it stays inside [0, 1] and is honest for small samples and rates near 0 or 1,
which is exactly where a freshly drifted loop sits.
"""

from __future__ import annotations

import math
from statistics import NormalDist


def wilson_interval(passed: int, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``passed`` successes out of ``n`` trials.

    With no trials nothing is known, so the interval is the whole of [0, 1].
    """
    if n < 0 or passed < 0 or passed > n:
        raise ValueError(f"need 0 <= passed <= n, got passed={passed}, n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = passed / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half_width = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half_width), min(1.0, centre + half_width)
