"""``GET /v1/loops/{loop}/ledger``: the serving ledger, both figures per champion."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import AdminDep, SessionDep, StateDep
from services.api.routes.loops import loop_or_404
from services.api.schemas.ledger import ChampionLedgerPublic, ServingLedgerPublic
from services.db.queries.serving_ledger import loop_champion_figures, value_per_success_usd

router = APIRouter(prefix="/v1/loops", tags=["loops"], dependencies=[AdminDep])


@router.get(
    "/{loop}/ledger",
    summary="Per champion: $/Mtok served, tokens served, live success, held-out pass rate, "
    "$ per held-out point, break-even tokens",
)
def ledger(loop: str, session: SessionDep, state: StateDep) -> ServingLedgerPublic:
    row = loop_or_404(session, loop)
    settings = state.settings
    figures = loop_champion_figures(
        session=session, loop=row, cached_token_weight=settings.serving_cached_token_weight
    )
    return ServingLedgerPublic(
        loop=row.name,
        serving_hour_price_usd=settings.serving_hour_price_usd,
        cached_token_weight=settings.serving_cached_token_weight,
        value_per_success_usd=value_per_success_usd(row.serving_target or {}),
        champions=[
            ChampionLedgerPublic(
                checkpoint_id=f.checkpoint_id,
                started_at=f.started_at,
                ended_at=f.ended_at,
                tokens_served=f.tokens_served,
                prompt_tokens=f.prompt_tokens,
                cached_prompt_tokens=f.cached_prompt_tokens,
                completion_tokens=f.completion_tokens,
                busy_seconds=f.busy_seconds,
                serving_cost_usd=f.serving_cost_usd,
                usd_per_mtok=f.usd_per_mtok,
                usd_per_mtok_computed=f.usd_per_mtok_computed,
                usd_per_mtok_cached=f.usd_per_mtok_cached,
                live_episodes=f.live_episodes,
                live_success_rate=f.live_success_rate,
                live_successes=f.live_successes,
                live_ci95=[f.live.low, f.live.high] if f.live is not None else None,
                heldout_pass_rate=f.heldout_pass_rate,
                heldout_tasks=f.heldout.n if f.heldout is not None else None,
                heldout_ci95=[f.heldout.low, f.heldout.high] if f.heldout is not None else None,
                cycle=f.cycle,
                cycle_cost_usd=f.cycle_cost_usd,
                usd_per_heldout_point=f.usd_per_heldout_point,
                break_even_tokens=f.break_even_tokens,
            )
            for f in figures
        ],
    )
