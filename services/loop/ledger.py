"""The serving ledger's arithmetic: what a sample adds to a tenure, $/Mtok, break-even.

A **tenure** is the time one version serves a loop: from its verified deploy (the
promotion's canary traffic is the candidate's) to the deploy that replaces it. The worker
samples the server's counters (:mod:`services.modelserver.usage`) at each deploy and at each
cycle's close and adds the difference since the previous sample to the open tenure.
Counters are per version on ``ratchet serve``, so when a sample is taken does not change
what is attributed to whom; a vLLM server's are whole-server, attributed to the version
serving between two samples.

Counters reset to 0 when the server restarts: a sample lower than the previous one in any
counter is read as a restart, and its own values (what was counted since the restart) are
the delta. A delta is never negative.

**Prices.** The serving cost of a sample is its busy compute-seconds (wall seconds served,
where the server does not measure busy time) * ``RATCHET_SERVING_HOUR_PRICE_USD`` / 3600.
$/Mtok served = cost / (prompt + completion tokens) * 1e6: the blended figure shown per
champion. Cached prompt tokens are priced separately: the cost is shared over tokens where a
cached prompt token weighs ``RATCHET_SERVING_CACHED_TOKEN_WEIGHT`` (default 0.1, the discount
hosted APIs give cached input) of a computed one, which gives a price per computed token and
one per cached token whose total is exactly the cost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.modelserver.usage import VersionUsage

MILLION = 1_000_000


@dataclass(frozen=True)
class ServingPrices:
    """The configured price of the serving hardware and the weight of a cached token."""

    hour_usd: float
    cached_token_weight: float


@dataclass(frozen=True)
class ServingLedger:
    """What the worker needs to keep the ledger: a reader of a loop's serving target's
    counters (``read(serving_target)``, raising on an unreadable server) and the prices."""

    read: Callable[[Mapping[str, Any]], Mapping[str, VersionUsage]]
    prices: ServingPrices


@dataclass(frozen=True)
class Accrual:
    """What one sample adds to a tenure."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    busy_seconds: float
    cost_usd: float


def delta(previous: VersionUsage | None, current: VersionUsage) -> VersionUsage:
    """The counters' growth since ``previous``; after a restart (any counter went down), the
    current values themselves. None as ``previous``: the first sample, nothing to add."""
    if previous is None:
        return VersionUsage(busy_seconds=None if current.busy_seconds is None else 0.0)
    pairs = [
        (previous.prompt_tokens, current.prompt_tokens),
        (previous.cached_prompt_tokens, current.cached_prompt_tokens),
        (previous.completion_tokens, current.completion_tokens),
    ]
    if previous.busy_seconds is not None and current.busy_seconds is not None:
        pairs.append((previous.busy_seconds, current.busy_seconds))
    if any(now < before for before, now in pairs):
        return current
    busy = (
        None
        if current.busy_seconds is None
        else current.busy_seconds - (previous.busy_seconds or 0.0)
    )
    return VersionUsage(
        prompt_tokens=current.prompt_tokens - previous.prompt_tokens,
        cached_prompt_tokens=current.cached_prompt_tokens - previous.cached_prompt_tokens,
        completion_tokens=current.completion_tokens - previous.completion_tokens,
        busy_seconds=busy,
    )


def accrue(
    previous: VersionUsage | None,
    current: VersionUsage,
    *,
    wall_seconds: float,
    prices: ServingPrices,
) -> Accrual:
    """A sample's addition to its tenure, priced; ``wall_seconds`` since the previous sample
    stands in for busy time where the server does not measure it."""
    grown = delta(previous, current)
    busy = grown.busy_seconds if grown.busy_seconds is not None else max(0.0, wall_seconds)
    if previous is None:
        busy = 0.0
    return Accrual(
        prompt_tokens=round(grown.prompt_tokens),
        cached_prompt_tokens=round(grown.cached_prompt_tokens),
        completion_tokens=round(grown.completion_tokens),
        busy_seconds=busy,
        cost_usd=busy * prices.hour_usd / 3600.0,
    )


def usd_per_mtok(cost_usd: float, tokens: int) -> float | None:
    """The blended $ per million tokens served; None before any token."""
    return cost_usd / tokens * MILLION if tokens > 0 else None


def token_prices(
    cost_usd: float,
    *,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    completion_tokens: int,
    cached_token_weight: float,
) -> tuple[float, float] | None:
    """($/Mtok of a computed token, $/Mtok of a cached prompt token): the cost shared over
    tokens weighted as the module docstring says; None before any token."""
    computed = prompt_tokens - cached_prompt_tokens + completion_tokens
    weighted = computed + cached_token_weight * cached_prompt_tokens
    if weighted <= 0:
        return None
    per_token = cost_usd / weighted * MILLION
    return per_token, per_token * cached_token_weight


def break_even_tokens(
    *,
    training_cost_usd: float,
    success_gain: float | None,
    value_per_success_usd: float | None,
    tokens_per_episode: float | None,
) -> float | None:
    """Tokens a champion must serve before its extra successes (``success_gain`` per
    episode, at ``value_per_success_usd`` each) repay its training cost; None when it cannot
    repay (no value stated, no gain, no measured episode size)."""
    if value_per_success_usd is None or value_per_success_usd <= 0:
        return None
    if success_gain is None or success_gain <= 0 or not tokens_per_episode:
        return None
    episodes = training_cost_usd / (success_gain * value_per_success_usd)
    return episodes * tokens_per_episode
