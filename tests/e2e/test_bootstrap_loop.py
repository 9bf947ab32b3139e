"""A first champion by bootstrap, end to end: a library desk's agent (a hosted model, say)
posts signed traces, failures and successes; the replay loop curates them and has no
champion; ``ratchet loop bootstrap`` (its api and client) trains an SFT-LoRA adapter over a
base model (a tiny random Llama) on the successful train-split conversations, evaluates the
adapter and the base model on the frozen held-out set, and at the manual gate, approved by
the operator, the adapter becomes the loop's first champion.

Every part is real (embedded Postgres and Temporal, ``ratchet api`` and ``ratchet worker``
processes, the local executor's jobs); the serving target is ``none`` because what is under
test is the bootstrap cycle, not serving. The assertions read Postgres rows and job files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from ratchet_client import TraceClient
from sqlalchemy import func, select

from services.client import LoopPolicies
from services.db.models import Checkpoint, Evaluation, Loop, Run, Task, Trace
from services.environments import read_task_file
from tests.e2e.support import LiveStack, cycle_closed, loop_cycle, wait_for
from tests.services.curation.bootstrap_traces import failure, success
from tests.services.training.hf_support import build_tiny_llama

pytestmark = pytest.mark.slow

LOOP = "desk"
TICKETS = range(12)
TRAINING_PROFILE: dict[str, Any] = {
    "family": "hf",
    "algorithm": "grpo",
    "device": "cpu",
    "hyperparameters": {"max_turns": 3, "max_new_tokens": 8, "threads": 1},
    "bootstrap": {
        "hyperparameters": {
            "steps": 2,
            "batch_size": 2,
            "micro_batch": 2,
            "lora_r": 4,
            "log_every": 0,
            "threads": 1,
        }
    },
}
CURATION_POLICY = {"eval_fraction": 0.3, "heldout_fraction": 0.3, "success_sample_rate": 0.0}
# No cycle but the bootstrap: the loop has no champion to train a regular one from.
TRIGGER_POLICY = {"min_new_tasks": 1000, "check_interval_s": 1, "drift_enabled": False}


def test_a_bootstrap_makes_the_first_champion(live: LiveStack, tmp_path: Path) -> None:
    base_dir = tmp_path / "base"
    base = build_tiny_llama(base_dir)
    with live.diagnostics(), live.client() as client:
        policies = LoopPolicies(
            serving_target={"kind": "none"},
            training_profile=TRAINING_PROFILE,
            gate_policy={
                "mode": "manual",
                "eval_samples": 1,
                "eval_temperature": 0.0,
                "canary_seconds": 0,
            },
            trigger_policy=TRIGGER_POLICY,
            curation_policy=CURATION_POLICY,
        )
        created = client.create_loop(LOOP, "replay", policies=policies)
        client.start_loop(LOOP)
        with TraceClient(live.api_url, LOOP, created.signing_secret) as traces:
            posted = traces.post([failure(n) for n in TICKETS] + [success(n) for n in TICKETS])
        assert posted.accepted == 2 * len(TICKETS)
        wait_for(_all_curated(live), timeout=300, interval=1, what="the traces curated")

        plan = client.bootstrap(LOOP, base=str(base_dir), reason="first champion")
        assert plan["status"] == "signalled" and plan["base_checkpoint_id"] == base.checkpoint_id
        report = plan["report"]
        assert (report["traces"], report["failures"], report["successes"]) == (24, 12, 12)
        assert report["used"] > 0

        wait_for(_waiting_at_the_gate(live), timeout=900, interval=1, what="the manual gate")
        client.action(LOOP, "approve", reason="bootstrap e2e", by="test")
        cycle = wait_for(cycle_closed(live, LOOP), timeout=300, interval=1, what="the close")
        assert cycle.outcome == "promoted", cycle.outcome_detail
        # The loop page says what the bootstrap learnt from.
        page = httpx.get(f"{live.api_url}/loops/{LOOP}", timeout=30).text
        assert 'id="bootstrap-report"' in page and "successes used (train split)" in page

    assert cycle.trigger == "bootstrap"
    assert cycle.trigger_detail["bootstrap"]["used"] == report["used"]
    assert cycle.trigger_detail["bootstrap"]["base_checkpoint"] == base.checkpoint_id
    with live.sessions()() as session:
        loop = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
        champion = session.get(Checkpoint, loop.champion_checkpoint_id)
        assert champion is not None and champion.id == cycle.candidate_checkpoint_id
        # An SFT-LoRA adapter over the base model.
        assert champion.manifest["kind"] == "lora"
        assert champion.manifest["base"]["checkpoint_id"] == base.checkpoint_id
        train = session.get(Run, f"{LOOP}-c1-train")
        assert train is not None and train.spec["algorithm"] == "sft"
        evaluations = session.scalars(
            select(Evaluation).where(Evaluation.cycle_id == cycle.id)
        ).all()
        assert {(e.checkpoint_id, e.task_set) for e in evaluations} == {
            (base.checkpoint_id, "heldout"),
            (champion.id, "heldout"),
        }
        train_tickets = _train_tickets(session, loop.id)
        success_ids = {
            trace.id: int(trace.external_id.removeprefix("ok-"))
            for trace in session.scalars(
                select(Trace).where(Trace.loop_id == loop.id, Trace.success.is_(True))
            )
        }
    demonstrations = read_task_file(Path(train.spec["dataset"]))
    used = {success_ids[t.metadata["ratchet"]["source_traces"][0]] for t in demonstrations}
    assert used == train_tickets  # every train-split success, and nothing else
    metrics = json.loads(Path(train.output_uri.removeprefix("file://"), "metrics.json").read_text())
    assert metrics["demonstrations"] >= len(used)


def _all_curated(live: LiveStack) -> Any:
    def check() -> None:
        with live.sessions()() as session:
            waiting = session.scalar(
                select(func.count()).select_from(Trace).where(Trace.curated_at.is_(None))
            )
        assert waiting == 0, f"{waiting} traces not curated yet"

    return check


def _waiting_at_the_gate(live: LiveStack) -> Any:
    def check() -> None:
        cycle = loop_cycle(live, LOOP)
        assert cycle.stage == "gate", (
            f"stage is {cycle.stage} ({cycle.outcome}: {cycle.outcome_detail})"
        )
        with live.sessions()() as session:
            evaluations = session.scalars(
                select(Evaluation).where(Evaluation.cycle_id == cycle.id)
            ).all()
        assert len(evaluations) == 2

    return check


def _train_tickets(session: Any, loop_id: int) -> set[int]:
    """The tickets whose failure task (and so cluster) curation put in the train split."""
    tasks = session.scalars(select(Task).where(Task.loop_id == loop_id, Task.split == "train"))
    return {int(t.spec["metadata"]["source"]["external_id"].removeprefix("fail-")) for t in tasks}
