"""A replay loop end to end: an OpenAI-tools agent (a library-loans desk, tools of the
test's own) posts signed traces; the loop curates them into replay tasks with reference
answers, trains an hf champion (a tiny random Llama) with GRPO in the replayed sandbox,
evaluates both models, and, at a manual gate an operator approves, promotes the candidate.

Every part is real (embedded Postgres and Temporal, ``ratchet api`` and ``ratchet worker``
processes, the local executor's jobs); the serving target is ``none`` because what is
under test is the cycle on replay tasks, not serving. The assertions read Postgres rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ratchet_client import TraceClient
from sqlalchemy import select

from services.client import LoopPolicies
from services.db.models import Dataset, Evaluation, Loop, Promotion, Task, Trace
from tests.e2e.support import LiveStack, cycle_closed, loop_cycle, new_tasks_trigger, wait_for
from tests.services.environments.replay_traces import failing_trace
from tests.services.training.hf_support import build_tiny_llama

pytestmark = pytest.mark.slow

LOOP = "desk"
TRACES = 12
TRAINING_PROFILE: dict[str, Any] = {
    "family": "hf",
    "algorithm": "grpo",
    "device": "cpu",
    "hyperparameters": {
        "steps": 1,
        "tasks_per_step": 2,
        "group_size": 2,
        "max_turns": 2,
        "max_new_tokens": 8,
        "lr": 1e-3,
        "log_every": 0,
        "threads": 1,
    },
}
CURATION_POLICY = {"eval_fraction": 0.3, "heldout_fraction": 0.0, "success_sample_rate": 0.0}


def _traces() -> list[dict[str, Any]]:
    """Distinct patrons and books: one cluster each, so the split has train and eval."""
    traces = []
    books = ["Dune", "Kindred", "Beloved", "Solaris", "Emma", "Ulysses"]
    for n in range(TRACES):
        trace = failing_trace(f"desk-{n}")
        book = f"{books[n % len(books)]} volume {n}"
        trace["messages"][1] = {
            "role": "user",
            "content": f"Patron P-{300 + n * 17} wants a hold on '{book}' at branch {n * 7}.",
        }
        traces.append(trace)
    return traces


def test_a_cycle_on_replay_tasks_promotes_an_hf_candidate(live: LiveStack, tmp_path: Path) -> None:
    champion_dir = tmp_path / "champion"
    build_tiny_llama(champion_dir)
    with live.diagnostics(), live.client() as client:
        policies = LoopPolicies(
            serving_target={"kind": "none"},
            training_profile=TRAINING_PROFILE,
            gate_policy={"mode": "manual", "eval_samples": 1, "canary_seconds": 0},
            trigger_policy=new_tasks_trigger(4),
            curation_policy=CURATION_POLICY,
        )
        created = client.create_loop(LOOP, "replay", policies=policies)
        client.set_champion(LOOP, str(champion_dir))
        with live.sessions()() as session:
            champion = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
            champion_id = champion.champion_checkpoint_id
        assert champion_id is not None
        with TraceClient(live.api_url, LOOP, created.signing_secret) as traces:
            traces.post(_traces())
        client.start_loop(LOOP)

        def waiting_at_the_gate() -> None:
            cycle = loop_cycle(live, LOOP)
            assert cycle.stage == "gate", (
                f"stage is {cycle.stage} ({cycle.outcome}: {cycle.outcome_detail})"
            )
            with live.sessions()() as session:
                evaluations = session.scalars(
                    select(Evaluation).where(Evaluation.cycle_id == cycle.id)
                ).all()
            assert len(evaluations) >= 2

        wait_for(waiting_at_the_gate, timeout=900, interval=1, what="the manual gate")
        client.action(LOOP, "approve", reason="replay e2e", by="test")
        cycle = wait_for(cycle_closed(live, LOOP), timeout=300, interval=1, what="cycle 1 closed")
        assert cycle.outcome == "promoted", cycle.outcome_detail

    with live.sessions()() as session:
        loop = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
        tasks = session.scalars(select(Task).where(Task.loop_id == loop.id)).all()
        promotion = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).one()
        dataset = session.scalars(select(Dataset).where(Dataset.loop_id == loop.id)).one()
        outcomes = session.scalars(select(Trace.curation_outcome).where(Trace.loop_id == loop.id))
        assert set(outcomes) == {"task"}
    assert {t.environment for t in tasks} == {"replay"}
    assert {t.spec["verifier"]["params"]["reward"]["source"] for t in tasks} == {"trace"}
    assert dataset.train_count > 0 and dataset.eval_count > 0
    assert promotion.decision == "promote" and promotion.decided_by == "test"
    assert loop.champion_checkpoint_id == promotion.candidate_checkpoint_id != champion_id
    manifest = Path(dataset.train_uri.removeprefix("file://")).parent / "manifest.json"
    assert '"tool_store"' in manifest.read_text()
