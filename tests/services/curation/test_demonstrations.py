"""Demonstrations in Postgres: a probe's and a train run's listed episodes become rows of
their train tasks, bounded per task; a file its listing does not vouch for, or episodes of
tasks that are not the run's, store nothing and say why on the run; the next train run's
spec names a file of the stored episodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from services.curation import demonstrations
from services.db.models import Dataset, DatasetTask, Demonstration, Run, Task
from services.db.queries import demonstrations as q
from services.db.session import SessionFactory
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.episode_file import EpisodeRecord, read_demonstrations, write_episodes
from tests.services.curation.support import make_loop


def seed(session_factory: SessionFactory) -> tuple[int, list[int], list[str], int]:
    """A loop with three train tasks and one eval task, a dataset of the train ones."""
    loop_id = make_loop(session_factory, "demos", environment="toolcalc")
    specs = ToolcalcEnvironment().generate_tasks(4, seed=5, api_version="v1")
    with session_factory.begin() as session:
        rows = [
            Task(
                loop_id=loop_id,
                content_hash=spec.task_id,
                environment="toolcalc",
                spec=spec.to_dict(),
                cluster_id=f"c{i}",
                split="eval" if i == 3 else "train",
            )
            for i, spec in enumerate(specs)
        ]
        session.add_all(rows)
        session.flush()
        dataset = Dataset(
            loop_id=loop_id,
            content_hash="d" * 64,
            train_count=3,
            eval_count=1,
            train_uri="file:///train.jsonl",
            eval_uri="file:///eval.jsonl",
        )
        session.add(dataset)
        session.flush()
        for row in rows:
            session.add(DatasetTask(dataset_id=dataset.id, task_id=row.id, split=row.split))
        return loop_id, [r.id for r in rows], [s.task_id for s in specs], dataset.id


def add_run(
    session_factory: SessionFactory, loop_id: int, run_id: str, kind: str, dataset_id: int | None
) -> None:
    with session_factory.begin() as session:
        session.add(
            Run(
                id=run_id,
                loop_id=loop_id,
                kind=kind,
                executor="local",
                spec={},
                status="succeeded",
                dataset_id=dataset_id,
            )
        )


def episode(task_hash: str, passed: bool, token: int = 7) -> EpisodeRecord:
    return EpisodeRecord(
        task_id=task_hash,
        passed=passed,
        reward=1.0 if passed else 0.2,
        text=f"call {token}",
        sequences=[([1, 2, token], [False, True, True])],
        checkpoint_id="ckpt-a",
        family="tiny",
    )


def record(
    session_factory: SessionFactory, run_id: str, out: Path, metrics: dict[str, Any], n: int
) -> int:
    with session_factory.begin() as session:
        run = session.get(Run, run_id)
        assert run is not None
        return demonstrations.record_job_episodes(
            session, run=run, output_dir=out, metrics=metrics, per_task=n
        )


def test_probe_episodes_are_stored_bounded_and_recording_twice_stores_nothing_twice(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id, task_ids, hashes, _ = seed(session_factory)
    add_run(session_factory, loop_id, "probe-1", "probe", None)
    episodes = [episode(hashes[0], True, t) for t in range(3)] + [episode(hashes[0], False)]
    metrics = {"episode_file": write_episodes(tmp_path, episodes)}

    assert record(session_factory, "probe-1", tmp_path, metrics, 2) == 3  # 2 successes
    assert record(session_factory, "probe-1", tmp_path, metrics, 2) == 0
    with session_factory() as session:
        rows = q.task_demonstrations(session=session, loop_id=loop_id, task_id=task_ids[0])
        assert [r.passed for r in rows] == [True, True, False]
        assert all(r.run_id == "probe-1" and r.source == "probe" for r in rows)
        assert rows[0].sequences[0] == [[1, 2, rows[0].sequences[0][0][2]], [False, True, True]]
        assert session.get(Run, "probe-1").error is None  # type: ignore[union-attr]


def test_a_tampered_file_stores_nothing_and_says_why_on_the_run(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id, _, hashes, _ = seed(session_factory)
    add_run(session_factory, loop_id, "probe-2", "probe", None)
    metrics = {"episode_file": write_episodes(tmp_path, [episode(hashes[0], True)])}
    (tmp_path / "episodes.jsonl").write_text("{}\n")
    assert record(session_factory, "probe-2", tmp_path, metrics, 4) == 0
    with session_factory() as session:
        run = session.get(Run, "probe-2")
        assert run is not None and run.status == "succeeded"
        assert run.error is not None and "episodes rejected" in run.error
        assert session.scalar(select(func.count()).select_from(Demonstration)) == 0


def test_episodes_of_an_eval_task_are_refused(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id, _, hashes, _ = seed(session_factory)
    add_run(session_factory, loop_id, "probe-3", "probe", None)
    episodes = [episode(hashes[0], True), episode(hashes[3], True)]  # hashes[3]: eval
    metrics = {"episode_file": write_episodes(tmp_path, episodes)}
    assert record(session_factory, "probe-3", tmp_path, metrics, 4) == 0
    with session_factory() as session:
        run = session.get(Run, "probe-3")
        assert run is not None and "not train tasks" in (run.error or "")


def test_the_next_train_run_reads_what_the_probe_stored(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    loop_id, _, hashes, dataset_id = seed(session_factory)
    add_run(session_factory, loop_id, "probe-4", "probe", None)
    probe_out = tmp_path / "probe"
    stored = [episode(hashes[1], True), episode(hashes[1], False, 9)]
    metrics = {"episode_file": write_episodes(probe_out, stored)}
    assert record(session_factory, "probe-4", probe_out, metrics, 4) == 2

    run_dir = tmp_path / "train-run"
    with session_factory() as session:
        keys = demonstrations.job_spec_keys(
            session,
            kind="train",
            run_dir=run_dir,
            loop_id=loop_id,
            dataset_id=dataset_id,
            per_task=4,
        )
        assert demonstrations.job_spec_keys(
            session, kind="probe", run_dir=run_dir, loop_id=loop_id, dataset_id=None, per_task=4
        ) == {"keep_episodes": 4}
        assert (
            demonstrations.job_spec_keys(
                session, kind="eval", run_dir=run_dir, loop_id=loop_id, dataset_id=None, per_task=4
            )
            == {}
        )
    assert keys["keep_episodes"] == 4
    assert read_demonstrations(Path(str(keys["demonstrations"]))) == stored

    # The train run's own successes are stored too, under its dataset's tasks.
    add_run(session_factory, loop_id, "train-4", "train", dataset_id)
    train_out = tmp_path / "train"
    metrics = {"episode_file": write_episodes(train_out, [episode(hashes[2], True)])}
    assert record(session_factory, "train-4", train_out, metrics, 4) == 1
    with session_factory() as session:
        sources = session.scalars(select(Demonstration.source).order_by(Demonstration.id)).all()
        assert sources == ["probe", "probe", "train"]
