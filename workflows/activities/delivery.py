"""Proof of delivery after a verified deploy (services.serving.delivery): the checkpoint's
probe set replayed against the serving endpoint, the result kept on the promotion the deploy
belongs to.

A mismatch or a bad probe set fails the deploy for good (the same weights answer the same);
an unreachable server may be retried. Recording the proof sets absolute values, so a retried
deploy writes the same note again.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from temporalio.exceptions import ApplicationError

from services.artifacts import uri_to_path
from services.db.queries import cycles as q
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.evaluation.probes import ProbeFileError, ProbeSet, read_listed_probes
from services.logs import log_context
from services.serving.base import DeployFailed, ServingError
from services.serving.delivery import DeliveryProof, not_verified
from workflows.activities.transactions import serving_failure, serving_mapping, transaction
from workflows.payloads.promote import DeployInput

logger = logging.getLogger(__name__)


class DeliveryProver(Protocol):
    """Proves a deploy's delivery with the checkpoint's probe set (None: it has none)."""

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, probes: ProbeSet | None
    ) -> DeliveryProof: ...


class Delivery:
    """Proves deploys and records the proofs; the deploy activities share it."""

    def __init__(self, session_factory: SessionFactory, prove: DeliveryProver | None) -> None:
        """``prove``: the worker's is ``ServingTargets.prove``; without one, deploys are
        noted as not verified."""
        self._sessions = session_factory
        self._prove = prove

    def prove(self, input: DeployInput) -> DeliveryProof:
        """Proof of delivery of a verified deploy, kept on the promotion it belongs to."""
        try:
            probes = self._probe_set(input.loop, input.checkpoint_id)
            if self._prove is None:
                proof = not_verified(input.checkpoint_id, "not verified: no prover configured")
            else:
                with log_context(loop=input.loop):
                    proof = self._prove(
                        serving_mapping(input.serving_target), input.checkpoint_id, probes
                    )
        except (ProbeFileError, DeployFailed) as exc:
            bad_file = isinstance(exc, ProbeFileError)
            reason = f"bad probe set: {exc}" if bad_file else str(exc)
            self._record(input, not_verified(input.checkpoint_id, reason))
            raise ApplicationError(
                reason, type="BadProbeSet" if bad_file else "DeliveryNotProven", non_retryable=True
            ) from exc
        except ServingError as exc:
            raise serving_failure(exc) from exc
        if not proof.verified:
            logger.warning("loop %s: deploy of %s: %s", input.loop, input.checkpoint_id, proof.note)
        self._record(input, proof)
        return proof

    def _probe_set(self, loop_name: str, checkpoint_id: str) -> ProbeSet | None:
        """The checkpoint's probe set, read only through the listing of the eval run that
        wrote it (held-out run first); None when no run of the loop lists one."""
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=loop_name)
            runs = q.evaluation_runs_of(session=session, loop=loop, checkpoint_id=checkpoint_id)
        for output_uri, metrics in runs:
            if output_uri and "probes" in metrics:
                return read_listed_probes(uri_to_path(output_uri), metrics)
        return None

    def _record(self, input: DeployInput, proof: DeliveryProof) -> None:
        """On the cycle's promotion (a candidate or restore deploy) or the held promotion an
        operator rollback undoes: the dashboard's loop page shows it."""
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop)
            if input.cycle is not None:
                promotion = q.cycle_promotion(
                    session=session,
                    cycle=q.get_cycle(session=session, loop=loop, number=input.cycle),
                )
            else:
                promotion = q.last_held_promotion(session=session, loop=loop)
            if promotion is not None:
                q.record_delivery(
                    session=session,
                    promotion=promotion,
                    purpose=input.purpose,
                    proof=proof.to_dict(),
                )
