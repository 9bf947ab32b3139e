"""What a job is handed (services.loop.job_documents): its document, files and nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.artifacts import ArtifactStore, path_to_uri, uri_to_path
from services.curation.demonstrations import train_job_inputs
from services.curation.snapshot import snapshot
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
from tests.services.curation.support import (
    add_traces,
    curate_all,
    make_loop,
    questions,
    trace_body,
)
from tests.support import assert_nothing_trained_is_judged


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


def test_a_train_job_replays_its_datasets_replay_split_copied_into_its_run_dir(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    replay_file = tmp_path / "replay.jsonl"
    replay_file.write_text('{"task": 1}\n', encoding="utf-8")
    regression = tmp_path / "regression.jsonl"
    regression.write_text('{"task": 9}\n', encoding="utf-8")
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
                # the regression suite judges the candidate: it is never what is replayed
                regression_count=1,
                regression_uri=path_to_uri(regression),
                replay_count=count,
                replay_uri=path_to_uri(replay_file) if count else None,
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
        assert copy.read_text(encoding="utf-8") == replay_file.read_text(encoding="utf-8")
        # Written once per run: a retried activity names the same bytes.
        replay_file.write_text('{"task": 2}\n', encoding="utf-8")
        assert replay("train", with_split.id, run_dir) == {"replay_dataset": str(copy)}
        assert copy.read_text(encoding="utf-8") == '{"task": 1}\n'
        # Nothing to replay: another kind, no replay split (a regression suite alone is
        # never replayed), no dataset, a file gone.
        assert replay("eval", with_split.id, tmp_path / "r2") == {}
        assert replay("train", without.id, tmp_path / "r3") == {}
        assert replay("train", None, tmp_path / "r4") == {}
        replay_file.unlink()
        assert replay("train", with_split.id, tmp_path / "r5") == {}


def test_no_task_a_train_job_is_handed_judges_its_candidate(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """The train job's document (its dataset, replay file and stored demonstrations) and
    the task sets the loop evaluates its candidate on (eval, regression, held-out), built
    from a real snapshot as the run_job activity builds them, share no task and no cluster.
    Replaying the regression suite (as train jobs once did) fails this test."""
    loop_id = make_loop(
        session_factory,
        name="trained-vs-judged",
        curation_policy={"success_sample_rate": 1.0, "heldout_fraction": 0.2},
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
    made = snapshot(session_factory, ArtifactStore(tmp_path / "a"), loop_name="trained-vs-judged")
    assert made.replay_count > 0 and made.regression_count > 0 and made.heldout_count > 0
    run_dir = tmp_path / "run"
    with session_factory.begin() as session:
        dataset, _ = job_files(
            session=session,
            kind="train",
            job_spec={},
            dataset_id=made.dataset_id,
            base_checkpoint_id=None,
        )
        spec: dict[str, object] = {
            "dataset": dataset,
            **replay_dataset(
                session=session, kind="train", run_dir=run_dir, dataset_id=made.dataset_id
            ),
            **train_job_inputs(
                session, run_dir=run_dir, loop_id=loop_id, dataset_id=made.dataset_id, per_task=4
            ),
        }
    assert spec["replay_dataset"]
    judged = {
        "eval": uri_to_path(made.eval_uri),
        "regression": uri_to_path(made.regression_uri or ""),
        "heldout": uri_to_path(made.heldout_uri or ""),
    }
    assert_nothing_trained_is_judged(spec, judged)
    # The guard has teeth: the regression suite as the replay file is caught.
    with pytest.raises(AssertionError, match="of the regression set is trained on"):
        assert_nothing_trained_is_judged({**spec, "replay_dataset": judged["regression"]}, judged)
