"""Model text that is not valid Unicode, from a job to the rows (issue 43, item 0).

The byte tokenizer decodes what the model sampled with ``surrogateescape``; bytes that are
not UTF-8 become lone surrogates, which Postgres cannot store. On main a train job that
sampled one failed its run's activity five times and the cycle with it. Here real jobs
(the local executor) write such text through the jobs' own writers and, as a job of another
image might, as raw JSON escapes; the worker's activities record them on a real Postgres.
Whether the closed-loop test samples such bytes is chance, so these tests are the guard.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select, text
from temporalio.testing import ActivityEnvironment

from services.artifacts import path_to_uri
from services.chat.text import REPLACEMENT
from services.db.models import Cycle, Dataset, DatasetTask, Demonstration, EvaluationResult, Loop
from services.db.session import SessionFactory
from services.training.tokenizer import ByteTokenizer
from tests.workflows.test_demonstrations_activity import probe_input, script, train_task
from tests.workflows.test_jobs_activity import World, record_run
from tests.workflows.test_loop_activities import add_checkpoint
from workflows.activities.gate import GateActivities
from workflows.payloads.evaluate import RecordEvaluationInput

SAMPLED = [*b"fmt(date=", 0xF9, 0xDC, 0x00, *b")"]  # two bytes no UTF-8 allows, and a NUL
STORED = f"fmt(date={REPLACEMENT * 3})"

# The job keeps two episodes of the task: one through the jobs' own writer
# (EpisodeRecord.to_json), one as another image's writer would put it (json.dumps of the
# decoded text: the surrogates as "\\udcf9" escapes); its metrics carry the text as well.
MODEL_TEXT_JOB = """
import hashlib, json, os, pathlib
from services.training.episode_file import EpisodeRecord
from services.training.tokenizer import ByteTokenizer
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
tokenizer = ByteTokenizer()
text = tokenizer.decode(SAMPLED)
assert tokenizer.encode(text) == SAMPLED  # inside the job the round trip holds
ours = EpisodeRecord(task_id=TASK_HASH, passed=True, reward=1.0, text=text,
                     sequences=[(SAMPLED, [True] * len(SAMPLED))], checkpoint_id="ck",
                     family="tiny")
foreign = {"task_id": TASK_HASH, "passed": False, "reward": 0.0, "text": text,
           "sequences": [[SAMPLED, [True] * len(SAMPLED)]], "checkpoint_id": "ck",
           "family": "tiny"}
data = (ours.to_json() + "\\n" + json.dumps(foreign) + "\\n").encode()
(out / "episodes.jsonl").write_bytes(data)
listing = {"file": "episodes.jsonl", "bytes": len(data), "count": 2,
           "sha256": hashlib.sha256(data).hexdigest(), "kinds": ["failure", "success"]}
metrics = {"episode_file": listing, "last_answer": text}
(out / "metrics.json").write_text(json.dumps(metrics))
"""


@pytest.fixture
def world(session_factory: SessionFactory, tmp_path: Path) -> World:
    return World(session_factory, tmp_path)


def test_the_tokenizer_really_decodes_to_lone_surrogates() -> None:
    """The premise: what the job writes is what the demo's tiny model produced."""
    decoded = ByteTokenizer().decode(SAMPLED)
    assert "\udcf9" in decoded and "\x00" in decoded
    with pytest.raises(UnicodeEncodeError):
        decoded.encode("utf-8")


async def test_invalid_utf8_a_job_sampled_reaches_the_rows_as_replacement_characters(
    world: World,
) -> None:
    task_id, task_hash = train_task(world)
    run_id = f"{world.loop}-c1-probe"
    job = f"TASK_HASH = {task_hash!r}\nSAMPLED = {SAMPLED!r}\n" + textwrap.dedent(MODEL_TEXT_JOB)
    activities = world.activities(job)

    result = await ActivityEnvironment().run(activities.run_job, probe_input(world, run_id))

    assert result.status == "succeeded" and result.error is None
    assert result.metrics["last_answer"] == STORED
    run = world.run_row(run_id)
    assert run.status == "succeeded" and run.metrics["last_answer"] == STORED
    with world.sessions() as session:
        rows = session.scalars(select(Demonstration).where(Demonstration.task_id == task_id))
        assert sorted((row.passed, row.text) for row in rows) == [(False, STORED), (True, STORED)]


async def test_a_demonstration_postgres_refuses_never_fails_the_run(world: World) -> None:
    """An auxiliary row that cannot be stored is said on the run; the run's outcome stands."""
    task_id, task_hash = train_task(world)
    with world.sessions.begin() as session:
        session.execute(
            text(
                "CREATE FUNCTION refuse_demonstrations() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'no room for demonstrations'; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON demonstrations FOR EACH ROW "
                "EXECUTE FUNCTION refuse_demonstrations()"
            )
        )
    run_id = f"{world.loop}-c1-probe"
    activities = world.activities(script(task_hash, tamper=False))

    result = await ActivityEnvironment().run(activities.run_job, probe_input(world, run_id))

    assert result.status == "succeeded"
    assert result.error is not None
    assert "demonstrations not recorded" in result.error
    assert "no room for demonstrations" in result.error
    run = world.run_row(run_id)
    assert run.status == "succeeded" and run.error == result.error
    with world.sessions() as session:
        assert session.query(Demonstration).filter_by(task_id=task_id).count() == 0


def test_an_evaluations_answers_are_stored_whatever_bytes_they_hold(world: World) -> None:
    """results.jsonl as a job of another image writes it (surrogate and NUL escapes)."""
    task_id, _ = train_task(world)
    with world.sessions.begin() as session:
        loop = session.query(Loop).filter_by(name=world.loop).one()
        job_task_id = session.execute(
            text("SELECT spec->>'task_id' FROM tasks WHERE id = :id"), {"id": task_id}
        ).scalar_one()
        dataset = Dataset(
            loop_id=loop.id,
            content_hash="d" * 64,
            train_count=0,
            eval_count=1,
            train_uri="file:///t",
            eval_uri="file:///e",
        )
        session.add_all([dataset, Cycle(loop_id=loop.id, number=1, trigger="operator")])
        session.flush()
        session.add(DatasetTask(dataset_id=dataset.id, task_id=task_id, split="eval"))
        dataset_id, loop_id = dataset.id, loop.id
    add_checkpoint(world.sessions, loop_id, "ck", 0)
    record_run(world, "eval-run")
    output = world.output_dir("eval-run")
    output.mkdir(parents=True)
    answer = ByteTokenizer().decode(SAMPLED)
    row = {"task_id": job_task_id, "passed": False, "reward": 0.0, "answer": answer}
    (output / "results.jsonl").write_text(json.dumps(row) + "\n")

    GateActivities(world.sessions).record_evaluation(
        RecordEvaluationInput(
            loop=world.loop,
            cycle=1,
            dataset_id=dataset_id,
            role="candidate",
            checkpoint_id="ck",
            task_set="eval",
            run_id="eval-run",
            output_uri=path_to_uri(output),
        )
    )

    with world.sessions() as session:
        stored = session.scalars(select(EvaluationResult)).one()
        assert stored.details["answer"] == STORED
