"""Wire models of the serving ledger: both figures per champion (cost per token served beside
intelligence per dollar), separate from the tables."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field


class ChampionLedgerPublic(BaseModel):
    """One version's tenure serving the loop, and what the cycle that produced it bought."""

    checkpoint_id: str
    started_at: dt.datetime = Field(description="when its deploy was verified")
    ended_at: dt.datetime | None = Field(description="when it was replaced; null: serving now")
    tokens_served: int = Field(description="prompt + completion tokens")
    prompt_tokens: int
    cached_prompt_tokens: int = Field(description="prompt tokens reused from the prefix cache")
    completion_tokens: int
    busy_seconds: float = Field(
        description="serving compute-seconds (the wall time served where the server does not "
        "measure busy time)"
    )
    serving_cost_usd: float
    usd_per_mtok: float | None = Field(description="$ per million tokens served, blended")
    usd_per_mtok_computed: float | None = Field(
        description="$ per million computed (prefilled or generated) tokens"
    )
    usd_per_mtok_cached: float | None = Field(
        description="$ per million cached prompt tokens (RATCHET_SERVING_CACHED_TOKEN_WEIGHT "
        "of a computed one)"
    )
    live_episodes: int
    live_success_rate: float | None
    live_successes: int = Field(default=0, description="successes among live_episodes")
    live_ci95: list[float] | None = Field(
        default=None, description="95% Wilson interval of the live success rate"
    )
    heldout_pass_rate: float | None
    heldout_tasks: int | None = Field(
        default=None, description="tasks of the held-out evaluation behind heldout_pass_rate"
    )
    heldout_ci95: list[float] | None = Field(
        default=None, description="95% interval of the held-out pass rate, as evaluated"
    )
    cycle: int | None = Field(description="the cycle that produced it; null: the base model")
    cycle_cost_usd: float | None
    usd_per_heldout_point: float | None
    break_even_tokens: float | None = Field(
        description="tokens it must serve before its live success gain over the previous "
        "champion repays its cycle's cost at the serving target's value_per_success_usd"
    )


class ServingLedgerPublic(BaseModel):
    loop: str
    serving_hour_price_usd: float
    cached_token_weight: float
    value_per_success_usd: float | None
    champions: list[ChampionLedgerPublic] = Field(description="oldest first")
