"""Activities of the canary: the live outcomes of a served version, and the promotion's
status as the canary moves it (deploying, canary, held or rolled back).

``live_stats`` is read-only; ``update_promotion`` sets absolute values, with timestamps set
once and kept on retries. Both are therefore idempotent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity

from services.db.queries import cycles as q
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.evaluation.stats import wilson_interval
from services.logs import log_context
from services.modelserver.attestation import TraceAttestation
from workflows.activities.transactions import parse_time, transaction
from workflows.payloads.promote import LiveStats, LiveStatsInput, PromotionStatusInput

# How the canary tells the traces a loop's serving target served (by the model server's
# signed response ids) from those that only say so; None: only the clients' word exists.
Attestation = Callable[[dict[str, Any]], TraceAttestation | None]


class CanaryActivities:
    """The canary's reads and the promotion's status."""

    def __init__(
        self, session_factory: SessionFactory, attestation: Attestation | None = None
    ) -> None:
        """``attestation``: how the canary tells served traces from claimed ones (None: it
        trusts the clients)."""
        self._sessions = session_factory
        self._attestation = attestation

    @activity.defn(name="live_stats")
    def live_stats(self, input: LiveStatsInput) -> LiveStats:
        """Read-only. Where the serving target signs its responses, only the traces whose
        response ids it signed for their version count: an agent's say-so cannot move the
        canary."""
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop)
            attested = self._attestation(loop.serving_target) if self._attestation else None
            counts = q.live_counts(
                session=session,
                loop=loop,
                model_version=input.model_version,
                since=parse_time(input.since),
                until=parse_time(input.until),
                limit=input.limit,
                attested=attested,
            )
        if counts.n == 0:
            return LiveStats(n=0, successes=0, success_rate=None, unattested=counts.unattested)
        low, high = wilson_interval(counts.successes, counts.n)
        rate = counts.successes / counts.n
        return LiveStats(counts.n, counts.successes, rate, low, high, counts.unattested)

    @activity.defn(name="update_promotion")
    def update_promotion(self, input: PromotionStatusInput) -> None:
        """Sets absolute values; timestamps are set once and kept on retries."""
        with log_context(loop=input.loop), transaction(self._sessions) as session:
            q.update_promotion(
                session=session,
                promotion_id=input.promotion_id,
                status=input.status,
                reason=input.reason,
                set_champion=input.set_champion,
                timestamp_field=input.timestamp_field,
            )

    def activities(self) -> list[Callable[..., Any]]:
        return [self.live_stats, self.update_promotion]
