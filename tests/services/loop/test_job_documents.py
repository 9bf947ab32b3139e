"""What a job is handed (services.loop.job_documents): its document, files and nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.artifacts import path_to_uri
from services.db.models import Checkpoint, Dataset, Loop
from services.db.session import SessionFactory
from services.executors.base import JobSpecError
from services.loop.job_documents import job_document, job_files, job_nodes


def test_the_document_names_its_run_unless_it_does_already() -> None:
    assert job_document({"kind": "train"}, "run-1") == {"kind": "train", "run_id": "run-1"}
    assert job_document({"run_id": "kept"}, "run-1") == {"run_id": "kept"}


@pytest.mark.parametrize("nodes", ["2", 2.0, True, None])
def test_nodes_must_be_an_integer(nodes: object) -> None:
    with pytest.raises(JobSpecError, match="the job spec's nodes must be an integer"):
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
