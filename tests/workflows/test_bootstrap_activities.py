"""The bootstrap's activities against a real Postgres and artifact store: the demonstrations
written once per cycle with the report on the cycle's row, the refusals, the automatic
bootstrap's readiness, and the gate deciding on the base model's and the adapter's
held-out results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select
from temporalio.exceptions import ApplicationError

from services.artifacts import ArtifactStore, uri_to_path
from services.checkpoints import install_checkpoint
from services.curation.snapshot import snapshot
from services.db.models import (
    Checkpoint,
    Cycle,
    Dataset,
    EvaluationResult,
    Loop,
    Run,
    Task,
)
from services.db.queries import cycles as q
from services.db.session import SessionFactory
from services.environments import read_task_file
from services.loop.states import Decision
from tests.services.curation.bootstrap_traces import POLICY, curate, failure, post, success
from tests.services.training.hf_support import build_tiny_llama
from workflows.activities.bootstrap import BootstrapActivities
from workflows.payloads.bootstrap import BootstrapReadinessInput, PrepareBootstrapInput
from workflows.payloads.gate import GateInput

TICKETS = range(12)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("base") / "tiny-llama"
    build_tiny_llama(directory)
    return directory


@dataclass
class Desk:
    loop_id: int
    store: ArtifactStore
    base_id: str
    successes: dict[int, int]  # trace id -> ticket
    activities: BootstrapActivities


def _make_desk(
    session_factory: SessionFactory, store: ArtifactStore, base_dir: Path, *, base: bool = True
) -> Desk:
    installed = install_checkpoint(base_dir, store)
    profile = {"family": "hf", **({"base_checkpoint": installed.checkpoint_id} if base else {})}
    with session_factory.begin() as session:
        loop = Loop(
            name="desk", environment="replay", curation_policy=POLICY, training_profile=profile
        )
        session.add(loop)
        session.flush()
        loop_id = loop.id
        session.add(Cycle(loop_id=loop_id, number=1, trigger="bootstrap", stage="curate"))
    post(session_factory, loop_id, [failure(n) for n in TICKETS])
    curate(session_factory, loop_id)
    ids = post(session_factory, loop_id, [success(n) for n in TICKETS])
    curate(session_factory, loop_id)
    activities = BootstrapActivities(session_factory, store)
    return Desk(
        loop_id, store, installed.checkpoint_id, dict(zip(ids, TICKETS, strict=True)), activities
    )


@pytest.fixture
def desk(session_factory: SessionFactory, tmp_path: Path, base_dir: Path) -> Desk:
    return _make_desk(session_factory, ArtifactStore(tmp_path / "artifacts"), base_dir)


def _train_tickets(session_factory: SessionFactory, loop_id: int) -> set[int]:
    with session_factory() as session:
        tasks = session.scalars(select(Task).where(Task.loop_id == loop_id)).all()
        return {
            int(t.spec["metadata"]["source"]["external_id"].removeprefix("fail-"))
            for t in tasks
            if t.split == "train"
        }


def test_prepare_writes_the_train_splits_successes_once_and_records_the_report(
    session_factory: SessionFactory, desk: Desk
) -> None:
    prepare = PrepareBootstrapInput("desk", 1, None, max_demonstrations=100)

    prepared = desk.activities.prepare(prepare)

    trained = _train_tickets(session_factory, desk.loop_id)
    assert prepared.base_checkpoint_id == desk.base_id
    assert prepared.used == len(trained) > 0
    assert prepared.demonstrations_uri is not None
    path = uri_to_path(prepared.demonstrations_uri)
    assert path.parent == desk.store.run_dir("desk", "desk-c1-train")
    tickets = {
        desk.successes[t.metadata["ratchet"]["source_traces"][0]] for t in read_task_file(path)
    }
    assert tickets == trained
    with session_factory() as session:
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == desk.loop_id)).one()
        recorded = cycle.trigger_detail["bootstrap"]
        assert (recorded["used"], recorded["failures"]) == (len(trained), len(TICKETS))
        assert recorded["base_checkpoint"] == desk.base_id
        assert session.get(Checkpoint, desk.base_id) is not None
    # A retry reads what the first attempt chose, whatever arrived since.
    post(session_factory, desk.loop_id, [success(40, external_id="late")])
    curate(session_factory, desk.loop_id)
    again = desk.activities.prepare(prepare)
    assert (again.used, again.report) == (prepared.used, prepared.report)


def test_prepare_refuses_a_loop_without_a_base_model(
    session_factory: SessionFactory, tmp_path: Path, base_dir: Path
) -> None:
    desk = _make_desk(session_factory, ArtifactStore(tmp_path / "art"), base_dir, base=False)
    with pytest.raises(ApplicationError, match="names no base model") as refused:
        desk.activities.prepare(PrepareBootstrapInput("desk", 1, None, max_demonstrations=10))
    assert refused.value.type == "BootstrapRefused" and refused.value.non_retryable


def test_readiness_looks_again_only_when_curation_moved(desk: Desk) -> None:
    first = desk.activities.readiness(BootstrapReadinessInput("desk", min_successes=1))
    assert first.ready and first.used == 1 and first.curated == 2 * len(TICKETS)
    unchanged = desk.activities.readiness(
        BootstrapReadinessInput("desk", min_successes=1, curated_seen=first.curated)
    )
    assert not unchanged.ready and unchanged.used == 0
    waiting = desk.activities.readiness(BootstrapReadinessInput("desk", min_successes=100))
    assert not waiting.ready and "successes used" in waiting.summary


def _evaluate(
    session_factory: SessionFactory, desk: Desk, checkpoint_id: str, passes: list[bool]
) -> None:
    """Store ``checkpoint_id``'s evaluation on the cycle's held-out set, task by task."""
    with session_factory.begin() as session:
        loop = session.get(Loop, desk.loop_id)
        assert loop is not None
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == loop.id)).one()
        dataset = session.get(Dataset, cycle.dataset_id)
        assert dataset is not None and dataset.heldout_uri is not None
        tasks = sorted(read_task_file(uri_to_path(dataset.heldout_uri)), key=lambda t: t.task_id)
        run_id = f"desk-c1-eval-{checkpoint_id[:8]}-heldout"
        session.add(Run(id=run_id, loop_id=loop.id, kind="eval", executor="local", spec={}))
        session.flush()
        # A model's answer may hold a NUL, which jsonb refuses: it is stored as U+FFFD.
        rows = [
            {"task_id": t.task_id, "passed": p, "answer": "ok\x00?"}
            for t, p in zip(tasks, passes, strict=False)
        ]
        record = q.EvaluationRecord(checkpoint_id, "heldout", dataset.id, run_id, rows, (0, 1))
        q.record_evaluation(session=session, loop=loop, cycle=cycle, record=record)


def test_the_gate_decides_on_the_heldout_set_against_the_base_model(
    session_factory: SessionFactory, desk: Desk
) -> None:
    desk.activities.prepare(PrepareBootstrapInput("desk", 1, None, max_demonstrations=100))
    dataset = snapshot(session_factory, desk.store, loop_name="desk", cycle=1)
    assert dataset.heldout_count >= 2
    with session_factory.begin() as session:
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == desk.loop_id)).one()
        cycle.dataset_id = dataset.dataset_id
        session.add(
            Checkpoint(
                id="adapter",
                loop_id=desk.loop_id,
                uri="file:///adapter",
                format="hf",
                size_bytes=1,
                sha256="0" * 64,
                manifest={},
            )
        )
    n = dataset.heldout_count
    _evaluate(session_factory, desk, desk.base_id, [False] * n)
    _evaluate(session_factory, desk, "adapter", [True] * n)
    judge = GateInput("desk", 1, desk.base_id, "adapter", 0.5, 0.0, 2.0, min_discordant_pairs=2)

    gate = desk.activities.gate(judge)

    assert gate.decision == Decision.PROMOTE
    assert gate.reason.startswith("bootstrap judged against the base model on the held-out set")
    assert f"vs base model 0.0% on {n} held-out tasks" in gate.reason
    statistics = gate.statistics
    assert statistics["heldout"]["n"] == n and statistics["heldout_points"] == 100.0
    assert statistics["decided_on"] == "heldout"
    with session_factory() as session:
        answers = set(session.scalars(select(EvaluationResult.details["answer"].as_string())))
    assert answers == {"ok\ufffd?"}
    strict = GateInput("desk", 1, desk.base_id, "adapter", 0.5, 0.0, 2.0, n + 1)
    assert desk.activities.gate(strict).decision == Decision.REJECT
