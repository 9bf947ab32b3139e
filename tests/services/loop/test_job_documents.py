"""What a job is handed (services.loop.job_documents): its document, files and nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.artifacts import path_to_uri
from services.db.models import Checkpoint, Dataset, Loop
from services.db.session import SessionFactory
from services.executors.base import JobRequestError
from services.loop.job_documents import (
    REPLAY_FILE,
    job_document,
    job_files,
    job_nodes,
    replay_dataset,
)


def test_the_document_names_its_run_unless_it_does_already() -> None:
    assert job_document({"kind": "train"}, "run-1") == {"kind": "train", "run_id": "run-1"}
    assert job_document({"run_id": "kept"}, "run-1") == {"run_id": "kept"}


@pytest.mark.parametrize("nodes", ["2", 2.0, True, None])
def test_nodes_must_be_an_integer(nodes: object) -> None:
    with pytest.raises(JobRequestError, match="the job spec's nodes must be an integer"):
        job_nodes({"nodes": nodes})


def test_one_node_unless_the_spec_says() -> None:
    assert job_nodes({}) == 1
    assert job_nodes({"nodes": 4}) == 4


def test_files_from_the_rows_the_stage_names(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    with session_factory.begin() as session:
        loop = Loop(name="docs", environment="toolcalc")
        session.add(loop)
        session.flush()
        dataset = Dataset(
            loop_id=loop.id,
            content_hash="h" * 64,
            train_uri=path_to_uri(tmp_path / "train.jsonl"),
            eval_uri=path_to_uri(tmp_path / "eval.jsonl"),
            train_count=1,
            eval_count=1,
        )
        checkpoint = Checkpoint(
            id="ckpt-docs",
            loop_id=loop.id,
            uri=path_to_uri(tmp_path / "ckpt"),
            format="safetensors",
            size_bytes=0,
            sha256="0" * 64,
            manifest={},
        )
        session.add_all([dataset, checkpoint])
        session.flush()

        def files(kind: str, spec: dict[str, str]) -> tuple[str | None, str | None]:
            return job_files(
                session=session,
                kind=kind,
                job_spec=spec,
                dataset_id=dataset.id,
                base_checkpoint_id=checkpoint.id,
            )

        assert files("train", {}) == (str(tmp_path / "train.jsonl"), str(tmp_path / "ckpt"))
        assert files("eval", {})[0] == str(tmp_path / "eval.jsonl")
        # The spec's own paths win over the rows.
        assert files("eval", {"dataset": "/d.jsonl", "checkpoint": "/c"}) == ("/d.jsonl", "/c")
        # Rows that are gone give no file.
        assert job_files(
            session=session,
            kind="train",
            job_spec={},
            dataset_id=dataset.id + 1000,
            base_checkpoint_id="ckpt-gone",
        ) == (None, None)


def test_a_train_job_replays_its_datasets_regression_split_copied_into_its_run_dir(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    regression = tmp_path / "regression.jsonl"
    regression.write_text('{"task": 1}\n', encoding="utf-8")
    with session_factory.begin() as session:
        loop = Loop(name="replay-docs", environment="toolcalc")
        session.add(loop)
        session.flush()
        with_split, without = (
            Dataset(
                loop_id=loop.id,
                content_hash=char * 64,
                train_uri=path_to_uri(tmp_path / "train.jsonl"),
                eval_uri=path_to_uri(tmp_path / "eval.jsonl"),
                train_count=1,
                eval_count=1,
                regression_count=count,
                regression_uri=path_to_uri(regression) if count else None,
            )
            for char, count in (("r", 1), ("n", 0))
        )
        session.add_all([with_split, without])
        session.flush()

        def replay(kind: str, dataset_id: int | None, run_dir: Path) -> dict[str, str]:
            return replay_dataset(
                session=session, kind=kind, run_dir=run_dir, dataset_id=dataset_id
            )

        run_dir = tmp_path / "run"
        copy = run_dir / REPLAY_FILE
        assert replay("train", with_split.id, run_dir) == {"replay_dataset": str(copy)}
        assert copy.read_text(encoding="utf-8") == regression.read_text(encoding="utf-8")
        # Written once per run: a retried activity names the same bytes.
        regression.write_text('{"task": 2}\n', encoding="utf-8")
        assert replay("train", with_split.id, run_dir) == {"replay_dataset": str(copy)}
        assert copy.read_text(encoding="utf-8") == '{"task": 1}\n'
        # Nothing to replay: another kind, no regression split, no dataset, a file gone.
        assert replay("eval", with_split.id, tmp_path / "r2") == {}
        assert replay("train", without.id, tmp_path / "r3") == {}
        assert replay("train", None, tmp_path / "r4") == {}
        regression.unlink()
        assert replay("train", with_split.id, tmp_path / "r5") == {}
