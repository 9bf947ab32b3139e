"""The serving ledger's rows: tenures opened, sampled and closed, and the per-champion read
model (services.loop.ledger holds the arithmetic)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db.models import Cycle, Evaluation, Loop, ServingTenure
from services.db.queries.live import live_counts
from services.db.queries.points import IntelligencePerDollar, intelligence_per_dollar
from services.evaluation.figures import Rate, rate
from services.loop.ledger import (
    ServingPrices,
    accrue,
    break_even_tokens,
    token_prices,
    usd_per_mtok,
)
from services.loop.policies import RECORDED, ServingTarget
from services.loop.states import LoopLifecycle
from services.modelserver.usage import VersionUsage, usage_of

LIVE_WINDOW = 1_000_000  # every trace of a tenure counts toward its live success


def open_tenure(*, session: Session, loop: Loop, for_update: bool = False) -> ServingTenure | None:
    query = select(ServingTenure).where(
        ServingTenure.loop_id == loop.id, ServingTenure.ended_at.is_(None)
    )
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def record_sample(
    *,
    session: Session,
    loop: Loop,
    served_version: str | None,
    usage: Mapping[str, VersionUsage] | None,
    now: dt.datetime,
    prices: ServingPrices,
) -> ServingTenure | None:
    """Add a sample of the server's counters to the loop's open tenure; when another version
    serves now (``served_version``), close that tenure and open one for it. ``usage`` None:
    the server could not be read, so nothing is added and the next sample starts afresh.
    Idempotent for a retried activity: a repeated sample adds a zero delta."""
    tenure = open_tenure(session=session, loop=loop, for_update=True)
    if tenure is not None:
        _add(tenure, usage, now, prices)
        if served_version is None or served_version == tenure.checkpoint_id:
            return tenure
        tenure.ended_at = now
        session.flush()
    if served_version is None:
        return None
    started = ServingTenure(
        loop_id=loop.id,
        checkpoint_id=served_version,
        baseline=_baseline(usage, served_version),
        started_at=now,
        sampled_at=now,
    )
    session.add(started)
    session.flush()
    return started


def _add(
    tenure: ServingTenure,
    usage: Mapping[str, VersionUsage] | None,
    now: dt.datetime,
    prices: ServingPrices,
) -> None:
    if usage is None:
        tenure.baseline = None
        tenure.sampled_at = now
        return
    current = usage_of(usage, tenure.checkpoint_id)
    previous = VersionUsage(**tenure.baseline) if tenure.baseline is not None else None
    since = tenure.sampled_at or tenure.started_at
    added = accrue(previous, current, wall_seconds=(now - since).total_seconds(), prices=prices)
    tenure.prompt_tokens += added.prompt_tokens
    tenure.cached_prompt_tokens += added.cached_prompt_tokens
    tenure.completion_tokens += added.completion_tokens
    tenure.busy_seconds += added.busy_seconds
    tenure.cost_usd += Decimal(str(round(added.cost_usd, 6)))
    tenure.baseline = _baseline(usage, tenure.checkpoint_id)
    tenure.sampled_at = now


def _baseline(
    usage: Mapping[str, VersionUsage] | None, version: str
) -> dict[str, float | None] | None:
    if usage is None:
        return None
    current = usage_of(usage, version)
    return {
        "prompt_tokens": current.prompt_tokens,
        "cached_prompt_tokens": current.cached_prompt_tokens,
        "completion_tokens": current.completion_tokens,
        "busy_seconds": current.busy_seconds,  # None: the server does not measure it
    }


# Read model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingTotals:
    tokens: int
    cost_usd: float


def serving_totals(*, session: Session, loop: Loop) -> ServingTotals:
    """Tokens served and their serving cost over the loop's life, every tenure together."""
    tokens, cost = session.execute(
        select(
            func.coalesce(
                func.sum(ServingTenure.prompt_tokens + ServingTenure.completion_tokens), 0
            ),
            func.coalesce(func.sum(ServingTenure.cost_usd), Decimal(0)),
        ).where(ServingTenure.loop_id == loop.id)
    ).one()
    return ServingTotals(int(tokens), float(cost))


@dataclass(frozen=True)
class ChampionFigures:
    """Both figures of one served version's tenure: what serving it cost per token, and
    what the cycle that produced it bought."""

    checkpoint_id: str
    started_at: dt.datetime
    ended_at: dt.datetime | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    busy_seconds: float
    serving_cost_usd: float
    usd_per_mtok: float | None
    usd_per_mtok_computed: float | None
    usd_per_mtok_cached: float | None
    live_episodes: int
    live_success_rate: float | None
    heldout_pass_rate: float | None
    cycle: int | None
    cycle_cost_usd: float | None
    usd_per_heldout_point: float | None
    break_even_tokens: float | None
    # What the two rates counted, with their 95 % intervals (services.evaluation.figures):
    # live successes of ``live_episodes``; the held-out evaluation's tasks and interval.
    live_successes: int = 0
    heldout: Rate | None = None

    @property
    def tokens_served(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def live(self) -> Rate | None:
        return rate(self.live_successes, self.live_episodes) if self.live_episodes else None


def loop_champion_figures(
    *, session: Session, loop: Loop, cached_token_weight: float
) -> list[ChampionFigures]:
    """:func:`champion_figures` at the value per success the loop's serving target states."""
    return champion_figures(
        session=session,
        loop=loop,
        cached_token_weight=cached_token_weight,
        value_per_success_usd=value_per_success_usd(loop.serving_target or {}),
    )


def value_per_success_usd(serving_target: Mapping[str, Any]) -> float | None:
    """The loop's stated value of a successful episode; None when unset or unparseable (a
    stored target that no longer parses still shows its ledger, without a break-even)."""
    try:
        policy = ServingTarget.model_validate(dict(serving_target), context=RECORDED)
    except ValidationError:
        return None
    return policy.value_per_success_usd


def champion_figures(
    *,
    session: Session,
    loop: Loop,
    cached_token_weight: float,
    value_per_success_usd: float | None,
) -> list[ChampionFigures]:
    """Every tenure of the loop, oldest first, with its serving and training figures. The
    break-even compares a tenure's live success with the previous tenure's."""
    tenures = session.scalars(
        select(ServingTenure)
        .where(ServingTenure.loop_id == loop.id)
        .order_by(ServingTenure.started_at, ServingTenure.id)
    ).all()
    bought = intelligence_per_dollar(session=session, loop_id=loop.id)
    figures: list[ChampionFigures] = []
    previous_success: float | None = None
    for tenure in tenures:
        row = _figures(session, loop, tenure, cached_token_weight, bought)
        gain = (
            row.live_success_rate - previous_success
            if row.live_success_rate is not None and previous_success is not None
            else None
        )
        per_episode = row.tokens_served / row.live_episodes if row.live_episodes else None
        even = break_even_tokens(
            training_cost_usd=row.cycle_cost_usd or 0.0,
            success_gain=gain,
            value_per_success_usd=value_per_success_usd,
            tokens_per_episode=per_episode,
        )
        figures.append(replace(row, break_even_tokens=even))
        if row.live_success_rate is not None:
            previous_success = row.live_success_rate
    return figures


def _figures(
    session: Session,
    loop: Loop,
    tenure: ServingTenure,
    cached_token_weight: float,
    bought: IntelligencePerDollar,
) -> ChampionFigures:
    """One tenure's figures; what its cycle bought is read from ``bought`` (the loop's
    intelligence per dollar), so its $ per held-out point is the one every page shows."""
    cost = float(tenure.cost_usd)
    tokens = tenure.prompt_tokens + tenure.completion_tokens
    prices = token_prices(
        cost,
        prompt_tokens=tenure.prompt_tokens,
        cached_prompt_tokens=tenure.cached_prompt_tokens,
        completion_tokens=tenure.completion_tokens,
        cached_token_weight=cached_token_weight,
    )
    live = live_counts(
        session=session,
        loop=loop,
        model_version=tenure.checkpoint_id,
        since=tenure.started_at,
        until=tenure.ended_at,
        limit=LIVE_WINDOW,
    )
    heldout = session.scalars(
        select(Evaluation)
        .where(Evaluation.checkpoint_id == tenure.checkpoint_id, Evaluation.task_set == "heldout")
        .order_by(Evaluation.created_at.desc())
        .limit(1)
    ).first()
    cycle = session.scalars(
        select(Cycle)
        .where(Cycle.loop_id == loop.id, Cycle.candidate_checkpoint_id == tenure.checkpoint_id)
        .order_by(Cycle.number)
        .limit(1)
    ).first()
    accounted = bought.of_cycle(cycle.number) if cycle is not None else None
    return ChampionFigures(
        checkpoint_id=tenure.checkpoint_id,
        started_at=tenure.started_at,
        ended_at=tenure.ended_at,
        prompt_tokens=tenure.prompt_tokens,
        cached_prompt_tokens=tenure.cached_prompt_tokens,
        completion_tokens=tenure.completion_tokens,
        busy_seconds=tenure.busy_seconds,
        serving_cost_usd=cost,
        usd_per_mtok=usd_per_mtok(cost, tokens),
        usd_per_mtok_computed=prices[0] if prices else None,
        usd_per_mtok_cached=prices[1] if prices else None,
        live_episodes=live.n,
        live_success_rate=live.successes / live.n if live.n else None,
        heldout_pass_rate=heldout.pass_rate if heldout is not None else None,
        cycle=cycle.number if cycle is not None else None,
        cycle_cost_usd=accounted.cost_usd if accounted is not None else None,
        usd_per_heldout_point=accounted.usd_per_point if accounted is not None else None,
        break_even_tokens=None,
        live_successes=live.successes,
        heldout=_heldout_rate(heldout),
    )


def _heldout_rate(evaluation: Evaluation | None) -> Rate | None:
    """The held-out evaluation's pass@1 over its tasks, with the interval it stored."""
    if evaluation is None or not evaluation.n:
        return None
    successes = min(max(evaluation.pass_rate, 0.0), 1.0) * evaluation.n
    return rate(successes, evaluation.n, interval=(evaluation.ci_low, evaluation.ci_high))


def serving_loop_names(*, session: Session, limit: int) -> list[str]:
    """The loops whose champion may be serving (every one not archived; a loop without a
    serving target is skipped by the sampler)."""
    return list(
        session.scalars(
            select(Loop.name)
            .where(Loop.status != LoopLifecycle.ARCHIVED)
            .order_by(Loop.id)
            .limit(limit)
        )
    )
