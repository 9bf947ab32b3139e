"""Proof of delivery in the deploy activity, against a real Postgres: the probe set is found
through the candidate's eval runs (held-out first) and read only through their listing, the
proof is kept on the promotion, a mismatch fails the deploy without retries, and a
checkpoint with no probe set deploys with a note.

The serving target and the prover are the dependencies replaced (the prover against real
``ratchet serve`` processes is tests/services/serving/test_delivery.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.exceptions import ApplicationError

from services.db.models import Cycle, Evaluation, Promotion, Run
from services.db.session import SessionFactory
from services.evaluation.probes import PROBES_FILE, Probe, ProbeSet, write_probes
from services.loop.policies import ServingTarget
from services.serving.base import DeployFailed
from services.serving.delivery import DeliveryProof, not_verified
from tests.workflows.test_loop_activities import (
    RecordingTarget,
    add_checkpoint,
    add_cycle,
    make_loop,
    set_champion,
)
from workflows.activities.stages import StageActivities
from workflows.payloads.promote import DeployInput
from workflows.payloads.rollback import RollbackInput


@dataclass
class RecordingProver:
    """Proves with what it is given; ``refuse`` makes it fail as a mismatch does."""

    refuse: str | None = None
    seen: list[tuple[str, ProbeSet | None]] = field(default_factory=list)

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, probes: ProbeSet | None
    ) -> DeliveryProof:
        self.seen.append((checkpoint_id, probes))
        if probes is None:
            return not_verified(checkpoint_id)
        if self.refuse:
            raise DeployFailed(self.refuse)
        return DeliveryProof(True, f"verified: {len(probes.probes)} probes", checkpoint_id, 1)


def a_probe(task_id: str) -> Probe:
    return Probe(
        task_id=task_id,
        messages=[{"role": "user", "content": "what is 2+2?"}],
        tools=[],
        max_tokens=4,
        prompt_token_ids=[1, 2],
        token_ids=[52],
        stop_id=10,
        logprobs=[-0.2, -0.1],
        text="4",
    )


def add_eval_run(
    session_factory: SessionFactory,
    tmp_path: Path,
    *,
    cycle_id: int,
    checkpoint: str,
    task_set: str,
    listed: bool = True,
    body: str | None = None,
) -> None:
    """A succeeded eval run of ``checkpoint`` with its evaluation row and output directory;
    its probe file listed in its metrics (or present but unlisted)."""
    out = tmp_path / f"{checkpoint}-{task_set}"
    out.mkdir()
    listing = write_probes(out, checkpoint, [a_probe(f"task-{task_set}")])
    if body is not None:  # a file that no longer parses, listed with its own hash
        (out / PROBES_FILE).write_text(body)
        listing["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    metrics = {"n": 1, **({"probes": listing} if listed else {})}
    with session_factory.begin() as session:
        cycle = session.get_one(Cycle, cycle_id)
        run_id = f"{checkpoint}-{task_set}-run"
        session.add(
            Run(
                id=run_id,
                loop_id=cycle.loop_id,
                cycle_id=cycle_id,
                kind="eval",
                executor="local",
                spec={},
                status="succeeded",
                output_uri=out.resolve().as_uri(),
                metrics=metrics,
            )
        )
        session.flush()
        session.add(
            Evaluation(
                loop_id=cycle.loop_id,
                cycle_id=cycle_id,
                checkpoint_id=checkpoint,
                run_id=run_id,
                task_set=task_set,
                n=1,
                passed=1,
                pass_rate=1.0,
                ci_low=0.0,
                ci_high=1.0,
            )
        )


@dataclass
class Cycle1:
    name: str
    cycle_id: int
    champion: str
    candidate: str


def cycle_with_promotion(session_factory: SessionFactory) -> Cycle1:
    """A loop whose cycle 1 decided to promote its candidate, now deploying."""
    loop_id, name = make_loop(session_factory)
    champion = add_checkpoint(session_factory, loop_id, f"{name}-champion", 0)
    candidate = add_checkpoint(session_factory, loop_id, f"{name}-candidate", 10)
    set_champion(session_factory, loop_id, champion)
    cycle_id = add_cycle(
        session_factory, loop_id, 1, champion=champion, candidate=candidate, ended=False
    )
    with session_factory.begin() as session:
        session.add(
            Promotion(
                loop_id=loop_id,
                cycle_id=cycle_id,
                decision="promote",
                status="deploying",
                reason="significant win",
                statistics={"delta_points": 12.5},
                candidate_checkpoint_id=candidate,
                previous_checkpoint_id=champion,
            )
        )
    return Cycle1(name, cycle_id, champion, candidate)


def delivery_of(session_factory: SessionFactory, cycle_id: int) -> dict[str, Any]:
    with session_factory() as session:
        promotion = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle_id)).one()
        assert promotion.statistics["delta_points"] == 12.5  # the gate's statistics stay
        delivery: dict[str, Any] = promotion.statistics["delivery"]
        return delivery


def deploy(activities: StageActivities, c: Cycle1, checkpoint: str, purpose: str) -> Any:
    return activities.deploy.deploy_checkpoint(
        DeployInput(c.name, ServingTarget(), checkpoint, f"file:///{checkpoint}", 1, purpose)
    )


def test_the_candidates_held_out_probe_set_proves_its_deploy(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    c = cycle_with_promotion(session_factory)
    add_eval_run(
        session_factory, tmp_path, cycle_id=c.cycle_id, checkpoint=c.candidate, task_set="eval"
    )
    add_eval_run(
        session_factory, tmp_path, cycle_id=c.cycle_id, checkpoint=c.candidate, task_set="heldout"
    )
    prover = RecordingProver()
    result = deploy(
        StageActivities.build(session_factory, RecordingTarget(), prove=prover),
        c,
        c.candidate,
        "candidate",
    )

    assert result.delivery == "verified: 1 probes"
    [(checkpoint, probes)] = prover.seen
    assert checkpoint == c.candidate and probes is not None
    assert [p.task_id for p in probes.probes] == ["task-heldout"]  # the held-out set first
    assert delivery_of(session_factory, c.cycle_id)["candidate"] == {
        "verified": True,
        "note": "verified: 1 probes",
        "checkpoint_id": c.candidate,
        "probes": 1,
    }


def test_a_mismatch_fails_the_deploy_for_good_and_says_why_on_the_promotion(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    c = cycle_with_promotion(session_factory)
    add_eval_run(
        session_factory, tmp_path, cycle_id=c.cycle_id, checkpoint=c.candidate, task_set="heldout"
    )
    why = "delivery not proven: probe 0 (task abc): token 3: expected id 52, got id 7"
    activities = StageActivities.build(
        session_factory, RecordingTarget(), prove=RecordingProver(refuse=why)
    )
    with pytest.raises(ApplicationError) as failed:
        deploy(activities, c, c.candidate, "candidate")
    assert failed.value.non_retryable and failed.value.type == "DeliveryNotProven"
    assert failed.value.message == why
    recorded = delivery_of(session_factory, c.cycle_id)["candidate"]
    assert recorded["verified"] is False and recorded["note"] == why


def test_no_probe_set_deploys_with_a_note_and_an_unlisted_file_is_not_one(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    c = cycle_with_promotion(session_factory)
    # An older run: its probe file is there, but its metrics do not list one.
    add_eval_run(
        session_factory,
        tmp_path,
        cycle_id=c.cycle_id,
        checkpoint=c.candidate,
        task_set="heldout",
        listed=False,
    )
    prover = RecordingProver()
    result = deploy(
        StageActivities.build(session_factory, RecordingTarget(), prove=prover),
        c,
        c.candidate,
        "candidate",
    )
    assert result.delivery == "not verified: no probe set"
    assert prover.seen == [(c.candidate, None)]
    assert delivery_of(session_factory, c.cycle_id)["candidate"]["note"] == (
        "not verified: no probe set"
    )


def test_a_malformed_listed_probe_set_is_a_clear_deploy_error(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    c = cycle_with_promotion(session_factory)
    body = json.dumps({"schema": "ratchet.probes/v1", "checkpoint_id": c.candidate, "probes": 3})
    add_eval_run(
        session_factory,
        tmp_path,
        cycle_id=c.cycle_id,
        checkpoint=c.candidate,
        task_set="heldout",
        body=body,
    )
    prover = RecordingProver()
    activities = StageActivities.build(session_factory, RecordingTarget(), prove=prover)
    with pytest.raises(
        ApplicationError, match=r"bad probe set: probes\.probes must be a list"
    ) as failed:
        deploy(activities, c, c.candidate, "candidate")
    assert failed.value.type == "BadProbeSet" and failed.value.non_retryable
    assert delivery_of(session_factory, c.cycle_id)["candidate"]["note"].startswith("bad probe set")
    assert prover.seen == []


def test_an_operator_rollback_is_proven_and_a_failed_proof_is_a_failed_rollback(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """The rollback puts the previous champion back: its own probe set (from the cycle that
    evaluated it) proves it, and a mismatch is recorded as a failed rollback."""
    c = cycle_with_promotion(session_factory)
    with session_factory.begin() as session:
        promotion = session.scalars(select(Promotion).where(Promotion.cycle_id == c.cycle_id)).one()
        promotion.status = "held"
    set_champion(session_factory, _loop_id(session_factory, c), c.candidate)
    add_eval_run(
        session_factory, tmp_path, cycle_id=c.cycle_id, checkpoint=c.champion, task_set="heldout"
    )
    why = "delivery not proven: probe 0 (task t): token 0: expected id 52, got id 9"
    refusing = StageActivities.build(
        session_factory, RecordingTarget(), prove=RecordingProver(refuse=why)
    )
    result = refusing.deploy.rollback_champion(RollbackInput(c.name, "live complaints"))
    assert not result.rolled_back and why in result.reason

    proving = StageActivities.build(session_factory, RecordingTarget(), prove=RecordingProver())
    assert proving.deploy.rollback_champion(RollbackInput(c.name, "live complaints")).rolled_back
    assert delivery_of(session_factory, c.cycle_id)["rollback"]["verified"] is True


def _loop_id(session_factory: SessionFactory, c: Cycle1) -> int:
    with session_factory() as session:
        return session.get_one(Cycle, c.cycle_id).loop_id
