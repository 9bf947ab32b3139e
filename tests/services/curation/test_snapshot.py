"""Dataset snapshots: immutable, content-addressed, with lineage; held-out never trained on."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from services.artifacts import ArtifactStore, uri_to_path
from services.curation.snapshot import DatasetSnapshot, SnapshotError, snapshot, weighted_sample
from services.curation.splits import JUDGED_SPLITS, TRAINED_SPLITS
from services.db.models import Cycle, Dataset, DatasetTask, Loop, Task, TaskSource
from services.db.queries import tasks as q
from services.db.session import SessionFactory
from services.environments.base import read_task_file
from tests.services.curation.support import (
    add_traces,
    curate_all,
    make_loop,
    questions,
    trace_body,
)

_names = (f"loop-{i}" for i in itertools.count())


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


def seeded_loop(session_factory: SessionFactory, n: int = 40, **policy: object) -> int:
    loop_id = make_loop(
        session_factory,
        name=next(_names),
        curation_policy={"success_sample_rate": 1.0, **policy},
    )
    bodies = [trace_body(f"f{i}", text, answer=str(i)) for i, text in enumerate(questions(n))]
    bodies += [
        trace_body(f"s{i}", text, answer=f"s{i}", success=True, error_kind=None)
        for i, text in enumerate(questions(3, seed=99))
    ]
    add_traces(session_factory, loop_id, bodies)
    curate_all(session_factory, loop_id)
    return loop_id


def loop_name(session_factory: SessionFactory, loop_id: int) -> str:
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        return loop.name


def test_snapshot_writes_files_rows_and_lineage(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(session_factory)
    name = loop_name(session_factory, loop_id)
    result = snapshot(session_factory, store, loop_name=name, cycle=1)
    assert result.created
    # 40 failures and 3 successes, every one in exactly one split; the held-out set is in
    # the dataset (evaluated, never trained on).
    assert result.heldout_count == heldout(session_factory, loop_id) > 0
    assert (
        result.train_count
        + result.eval_count
        + result.regression_count
        + result.heldout_count
        + result.replay_count
        == 43
    )
    directory = store.dataset_dir(name, result.content_hash)
    assert uri_to_path(result.train_uri) == directory / "train.jsonl"
    train = read_task_file(uri_to_path(result.train_uri))
    evaluation = read_task_file(uri_to_path(result.eval_uri))
    regression = read_task_file(uri_to_path(result.regression_uri or ""))
    held = read_task_file(uri_to_path(result.heldout_uri or ""))
    assert (len(train), len(evaluation), len(regression), len(held)) == (
        result.train_count,
        result.eval_count,
        result.regression_count,
        result.heldout_count,
    )
    assert {t.metadata["ratchet"]["split"] for t in held} == {"heldout"}
    assert not {t.task_id for t in held} & {t.task_id for t in train}
    assert (directory / "manifest.json").is_file()
    with session_factory() as session:
        members = session.execute(
            select(DatasetTask.task_id, DatasetTask.split).where(
                DatasetTask.dataset_id == result.dataset_id
            )
        ).all()
        sources = dict(session.execute(select(TaskSource.task_id, TaskSource.trace_id)).all())
        splits = dict(session.execute(select(Task.id, Task.split)).all())
    assert len(members) == 43
    for task in train:
        lineage = task.metadata["ratchet"]
        assert lineage["split"] == "train" == splits[lineage["task_id"]]
        assert lineage["source_traces"] == [sources[lineage["task_id"]]]
    assert {t.metadata["ratchet"]["split"] for t in evaluation} <= {"eval"}


def heldout(session_factory: SessionFactory, loop_id: int) -> int:
    with session_factory() as session:
        return q.heldout_count(session=session, loop_id=loop_id)


def test_same_content_gives_the_same_dataset(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(session_factory, n=12)
    name = loop_name(session_factory, loop_id)
    first = snapshot(session_factory, store, loop_name=name, cycle=1)
    train_bytes = uri_to_path(first.train_uri).read_bytes()
    again = snapshot(session_factory, store, loop_name=name, cycle=2)
    assert (again.dataset_id, again.content_hash, again.created) == (
        first.dataset_id,
        first.content_hash,
        False,
    )
    add_traces(session_factory, loop_id, [trace_body("late", "a brand new failure", answer="x")])
    curate_all(session_factory, loop_id)
    later = snapshot(session_factory, store, loop_name=name, cycle=3)
    assert later.dataset_id != first.dataset_id and later.created
    assert uri_to_path(first.train_uri).read_bytes() == train_bytes
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(Dataset)) == 2


def test_difficulty_filter_and_pending_work(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(
        session_factory, n=30, eval_fraction=0.0, heldout_fraction=0.0, difficulty_filter=True
    )
    with session_factory.begin() as session:
        train = [
            m.task_id for m in q.split_members(session=session, loop_id=loop_id, split="train")
        ]
        assert len(train) == 30
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 30
        q.record_probe_results(
            session=session,
            loop_id=loop_id,
            pass_rates={train[0]: 1.0, train[1]: 0.0, train[2]: 0.5},
        )
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 28
    name = loop_name(session_factory, loop_id)
    result = snapshot(session_factory, store, loop_name=name)
    assert result.train_count == 28
    counts = {"kept": 28, "too_easy": 1, "too_hard": 1, "unprobed": 27}
    assert result.difficulty == counts
    # The same content again: the stored dataset, with the counts it recorded.
    assert snapshot(session_factory, store, loop_name=name).difficulty == counts
    with session_factory() as session:
        dataset = session.get(Dataset, result.dataset_id)
        assert dataset is not None
        assert dataset.stats["difficulty"] == {
            "kept": 28,
            "too_easy": 1,
            "too_hard": 1,
            "unprobed": 27,
        }
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 0


def test_a_bootstrap_snapshot_leaves_the_train_tasks_new(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    """A bootstrap cycle's dataset holds the train split but trains on successes, so its
    tasks still count as new for ``min_new_tasks``; once a regular cycle used a dataset
    holding them (the same one, content-addressed, or another), they no longer do."""
    loop_id = seeded_loop(session_factory, n=30, eval_fraction=0.0, heldout_fraction=0.0)
    name = loop_name(session_factory, loop_id)
    dataset_id = snapshot(session_factory, store, loop_name=name).dataset_id
    with session_factory.begin() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 0  # no cycle's yet
        session.add(
            Cycle(
                loop_id=loop_id,
                number=1,
                trigger="bootstrap",
                stage="done",
                outcome="promoted",
                ended_at=func.now(),
                dataset_id=dataset_id,
            )
        )
    with session_factory.begin() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 30
        session.add(
            Cycle(
                loop_id=loop_id, number=2, trigger="operator", stage="train", dataset_id=dataset_id
            )
        )
    with session_factory() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 0


def test_tasks_a_capped_sample_left_out_are_not_new_after_a_cycle(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    """``max_train_tasks`` samples the train split; once a regular cycle trained on that
    sample, the tasks it left out do not count as new (the next draw would leave them out
    again, so counting them started cycle after cycle), and tasks curated later do."""
    loop_id = seeded_loop(
        session_factory, n=30, eval_fraction=0.0, heldout_fraction=0.0, max_train_tasks=10
    )
    name = loop_name(session_factory, loop_id)
    dataset_id = snapshot(session_factory, store, loop_name=name).dataset_id
    with session_factory.begin() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 20  # no cycle yet
        session.add(
            Cycle(
                loop_id=loop_id, number=1, trigger="operator", stage="train", dataset_id=dataset_id
            )
        )
    with session_factory() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 0
    later = [trace_body(f"n{i}", text, answer=str(i)) for i, text in enumerate(questions(4, 7))]
    add_traces(session_factory, loop_id, later)
    curate_all(session_factory, loop_id)
    with session_factory() as session:
        assert q.count_new_train_tasks(session=session, loop_id=loop_id) == 4


def test_without_the_difficulty_filter_probe_rates_are_ignored(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(session_factory, n=10, eval_fraction=0.0, heldout_fraction=0.0)
    with session_factory.begin() as session:
        train = [
            m.task_id for m in q.split_members(session=session, loop_id=loop_id, split="train")
        ]
        q.record_probe_results(session=session, loop_id=loop_id, pass_rates={train[0]: 1.0})
    result = snapshot(session_factory, store, loop_name=loop_name(session_factory, loop_id))
    assert result.train_count == len(train)
    assert result.difficulty == {"kept": len(train), "too_easy": 0, "too_hard": 0, "unprobed": 0}


def test_pinned_tasks_are_regression_only_and_heldout_cannot_be_pinned(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(session_factory, n=20, heldout_fraction=0.3, heldout_max_tasks=100)
    with session_factory.begin() as session:
        train = q.split_members(session=session, loop_id=loop_id, split="train")
        held = session.scalars(
            select(Task.id).where(Task.loop_id == loop_id, Task.split == "heldout")
        ).all()
        assert held, "the seed should put some clusters in held-out"
        pinned = q.pin_tasks(session=session, loop_id=loop_id, task_ids=[train[0].task_id, held[0]])
        assert pinned == [train[0].task_id]
    result = snapshot(session_factory, store, loop_name=loop_name(session_factory, loop_id))
    train_ids = {
        t.metadata["ratchet"]["task_id"] for t in read_task_file(uri_to_path(result.train_uri))
    }
    regression = read_task_file(uri_to_path(result.regression_uri or ""))
    assert train[0].task_id not in train_ids
    assert train[0].task_id in {t.metadata["ratchet"]["task_id"] for t in regression}


def test_lost_files_and_unknown_loops_are_clear_errors(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    loop_id = seeded_loop(session_factory, n=5)
    name = loop_name(session_factory, loop_id)
    result = snapshot(session_factory, store, loop_name=name)
    uri_to_path(result.train_uri).unlink()
    with pytest.raises(SnapshotError, match="its files are gone"):
        snapshot(session_factory, store, loop_name=name)
    with pytest.raises(SnapshotError, match="does not exist"):
        snapshot(session_factory, store, loop_name="nope")


def assert_trained_apart_from_judged(result: DatasetSnapshot) -> None:
    """The dataset's trained splits (train, replay) share no task and no cluster with the
    splits that judge a candidate (eval, regression, held-out); checked on the files a
    train job and the gate read, and on the dataset's rows."""
    files = {
        "train": result.train_uri,
        "replay": result.replay_uri,
        "eval": result.eval_uri,
        "regression": result.regression_uri,
        "heldout": result.heldout_uri,
    }
    tasks = {split: read_task_file(uri_to_path(uri or "")) for split, uri in files.items()}
    for split, members in tasks.items():
        assert {t.metadata["ratchet"]["split"] for t in members} <= {split}
    trained = [t for split in TRAINED_SPLITS for t in tasks[split]]
    judged = [t for split in JUDGED_SPLITS for t in tasks[split]]
    assert not {t.task_id for t in trained} & {t.task_id for t in judged}
    trained_clusters = {t.metadata["ratchet"]["cluster_id"] for t in trained}
    assert not trained_clusters & {t.metadata["ratchet"]["cluster_id"] for t in judged}
    assert result.replay_count == len(tasks["replay"])


def test_successes_are_replayed_or_judge_never_both(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    """Sampled successes split by cluster: those on the trained side are the replay pool a
    train job replays, the rest the regression suite the gate judges by; none is both, and
    a success stays on its side in the next dataset."""
    loop_id = make_loop(
        session_factory, name=next(_names), curation_policy={"success_sample_rate": 1.0}
    )
    add_traces(
        session_factory,
        loop_id,
        [trace_body(f"f{i}", text, answer=str(i)) for i, text in enumerate(questions(30))]
        + [
            trace_body(f"s{i}", text, answer=f"s{i}", success=True, error_kind=None)
            for i, text in enumerate(questions(60, seed=7))
        ],
    )
    curate_all(session_factory, loop_id)
    name = loop_name(session_factory, loop_id)
    first = snapshot(session_factory, store, loop_name=name, cycle=1)
    assert first.replay_count > 0 and first.regression_count > 0
    assert_trained_apart_from_judged(first)
    with session_factory() as session:
        rows = session.execute(
            select(DatasetTask.task_id, DatasetTask.split).where(
                DatasetTask.dataset_id == first.dataset_id
            )
        ).all()
    assert {split for _, split in rows} >= {"replay", "regression"}
    sides = {task_id: split for task_id, split in rows if split in ("replay", "regression")}
    add_traces(
        session_factory,
        loop_id,
        [trace_body("f-late", "a brand new failure of a new kind", answer="x")],
    )
    curate_all(session_factory, loop_id)
    second = snapshot(session_factory, store, loop_name=name, cycle=2)
    assert second.dataset_id != first.dataset_id
    assert_trained_apart_from_judged(second)
    with session_factory() as session:
        again = dict(
            session.execute(
                select(DatasetTask.task_id, DatasetTask.split).where(
                    DatasetTask.dataset_id == second.dataset_id,
                    DatasetTask.task_id.in_(list(sides)),
                )
            ).all()
        )
    assert again == sides


def test_a_leaking_selection_is_refused(
    session_factory: SessionFactory, store: ArtifactStore
) -> None:
    """A replay task whose cluster also holds an eval task (a broken invariant, made here
    by hand) stops the snapshot instead of writing a dataset that trains on what judges."""
    loop_id = seeded_loop(session_factory, n=20)
    with session_factory.begin() as session:
        evaluation = session.scalars(
            select(Task).where(Task.loop_id == loop_id, Task.split == "eval").limit(1)
        ).one()
        success = session.scalars(
            select(Task).where(Task.loop_id == loop_id, Task.split == "regression").limit(1)
        ).one()
        # the success joins the eval task's cluster; the cluster is also made a train one
        success.cluster_id = evaluation.cluster_id
        train = session.scalars(
            select(Task).where(Task.loop_id == loop_id, Task.split == "train").limit(1)
        ).one()
        train.cluster_id = evaluation.cluster_id
    with pytest.raises(SnapshotError, match="refusing to write a leaking dataset"):
        snapshot(session_factory, store, loop_name=loop_name(session_factory, loop_id))


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(5, 40),
    seed=st.integers(0, 1000),
    eval_fraction=st.floats(0.0, 0.4),
    heldout_fraction=st.floats(0.05, 0.5),
    heldout_max=st.integers(0, 10),
    probes=st.lists(st.sampled_from([0.0, 0.5, 1.0]), max_size=10),
)
def test_heldout_and_the_judging_sets_never_enter_a_training_dataset(
    session_factory: SessionFactory,
    store: ArtifactStore,
    n: int,
    seed: int,
    eval_fraction: float,
    heldout_fraction: float,
    heldout_max: int,
    probes: list[float],
) -> None:
    loop_id = make_loop(
        session_factory,
        name=next(_names),
        curation_policy={
            "eval_fraction": eval_fraction,
            "heldout_fraction": heldout_fraction,
            "heldout_max_tasks": heldout_max,
            "cluster_threshold": 0.5,
            "near_duplicate_threshold": 0.9,
            "difficulty_filter": True,
            "success_sample_rate": 1.0,
        },
    )
    texts = questions(n, seed)
    # Near-variants of earlier questions, so clusters have several members.
    texts += [t + " please" for t in texts[: n // 2]]
    # Successes too, some of them variants of failures (the same clusters).
    successes = questions(n // 2, seed + 1) + [t + " thanks" for t in texts[: n // 3]]
    add_traces(
        session_factory,
        loop_id,
        [trace_body(f"t{i}", text, answer=str(i)) for i, text in enumerate(texts)]
        + [
            trace_body(f"s{i}", text, answer=f"s{i}", success=True, error_kind=None)
            for i, text in enumerate(successes)
        ],
    )
    curate_all(session_factory, loop_id)
    with session_factory.begin() as session:
        ids = session.scalars(
            select(Task.id).where(Task.loop_id == loop_id).order_by(Task.id)
        ).all()
        rates = dict(zip(ids, probes, strict=False))
        q.record_probe_results(session=session, loop_id=loop_id, pass_rates=rates)
    result = snapshot(session_factory, store, loop_name=loop_name(session_factory, loop_id))
    with session_factory() as session:
        rows = session.execute(
            select(Task.id, Task.split, Task.cluster_id).where(Task.loop_id == loop_id)
        ).all()
    split_of = {row[0]: row[1] for row in rows}
    held_clusters = {row[2] for row in rows if row[1] in ("heldout", "eval")}
    train = read_task_file(uri_to_path(result.train_uri))
    for task in train:
        task_id = task.metadata["ratchet"]["task_id"]
        assert split_of[task_id] == "train"
        assert task.metadata["ratchet"]["cluster_id"] not in held_clusters
    assert sum(1 for s in split_of.values() if s == "heldout") <= heldout_max
    assert_trained_apart_from_judged(result)


def test_train_sampling_follows_the_dedup_weights() -> None:
    """Over the cap, a task folded from many traces is likelier in: weights drive the draw."""
    heavy = [q.SplitMember(i, f"heavy-{i}", 20, None, False) for i in range(100)]
    light = [q.SplitMember(100 + i, f"light-{i}", 1, None, False) for i in range(100)]
    members = heavy + light
    chosen = weighted_sample(members, 50)
    assert len(chosen) == 50 == len({m.task_id for m in chosen})
    assert sum(m.weight == 20 for m in chosen) >= 40
    # A pure function of the tasks: the same draw again, whatever the order given.
    assert {m.task_id for m in weighted_sample(list(reversed(members)), 50)} == {
        m.task_id for m in chosen
    }
    assert weighted_sample(members[:10], 50) == members[:10]
