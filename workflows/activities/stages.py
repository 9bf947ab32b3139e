"""The loop's activities by stage, built from one set of dependencies.

Each stage's activities are their own small class (cycle.py, gate.py, deploy.py,
canary.py, serving_ledger.py); the stages share two helpers that are no activities, the
serving ledger's sampler and the proof of delivery. :meth:`StageActivities.build` wires them
the one way the worker (workflows/registry.py) and the tests do, and
:meth:`StageActivities.activities` lists what a worker registers. Registered names are the
activities' own (``@activity.defn(name=...)``), unchanged by the split, so committed
histories still name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.db.session import SessionFactory
from services.loop.ledger import ServingLedger
from workflows.activities.canary import Attestation, CanaryActivities
from workflows.activities.cycle import CycleActivities
from workflows.activities.delivery import Delivery, DeliveryProver
from workflows.activities.deploy import DeployActivities, ServingDeployer
from workflows.activities.gate import GateActivities
from workflows.activities.serving_ledger import ServingLedgerActivities, ServingSampler


@dataclass(frozen=True)
class StageActivities:
    """One instance of each stage's activity class."""

    cycle: CycleActivities
    gate: GateActivities
    deploy: DeployActivities
    canary: CanaryActivities
    ledger: ServingLedgerActivities

    @classmethod
    def build(
        cls,
        session_factory: SessionFactory,
        deploy: ServingDeployer,
        *,
        attestation: Attestation | None = None,
        serving_ledger: ServingLedger | None = None,
        prove: DeliveryProver | None = None,
    ) -> StageActivities:
        """``deploy``: the serving targets' deploy; ``attestation``: how the canary tells
        served traces from claimed ones (None: it trusts the clients); ``serving_ledger``:
        where the serving ledger's samples are read (None: not kept); ``prove``: proof of
        delivery after every deploy (the worker's is ``ServingTargets.prove``; None: deploys
        are noted as not verified)."""
        sampler = ServingSampler(session_factory, serving_ledger)
        return cls(
            cycle=CycleActivities(session_factory, sampler),
            gate=GateActivities(session_factory),
            deploy=DeployActivities(
                session_factory, deploy, sampler, Delivery(session_factory, prove)
            ),
            canary=CanaryActivities(session_factory, attestation),
            ledger=ServingLedgerActivities(session_factory, sampler),
        )

    def activities(self) -> list[Callable[..., Any]]:
        return [
            *self.cycle.activities(),
            *self.gate.activities(),
            *self.deploy.activities(),
            *self.canary.activities(),
            *self.ledger.activities(),
        ]
