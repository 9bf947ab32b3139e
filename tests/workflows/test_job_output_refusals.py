"""Job output the worker refuses, and the run ends saying why (issue 43, item 8).

- ``metrics.json`` with NaN or Infinity: JSON has no such numbers and Postgres ``jsonb``
  refuses them, so on main the run's row could never be finished and the run stayed
  ``running`` while the activity retried;
- a symbolic link on the way to a job's output or anywhere inside it: readers open files
  with ``O_NOFOLLOW``, which guards a file's own name only, so ``output/checkpoint ->
  /elsewhere`` led the worker out of the run's directory.

Real jobs through the local executor, real Postgres.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from services.db.session import SessionFactory
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.workflows.test_jobs_activity import JOB_HEADER, World, record_run
from workflows.payloads.jobs import RegisterCheckpointInput


@pytest.fixture
def world(session_factory: SessionFactory, tmp_path: Path) -> World:
    return World(session_factory, tmp_path)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_a_non_finite_metric_fails_the_run_with_the_reason(world: World, number: str) -> None:
    job = JOB_HEADER + f'(out / "metrics.json").write_text(\'{{"loss": {number}}}\')\n'
    input = world.job_input()

    result = await ActivityEnvironment().run(world.activities(job).run_job, input)

    assert result.status == "failed"
    assert result.error is not None and "metrics.json" in result.error
    assert "finite" in result.error
    run = world.run_row(input.run_id)
    assert run.status == "failed" and run.ended_at is not None and run.metrics == {}


def checkpoint_job(elsewhere: Path, *, link: str) -> str:
    """A job that writes a real checkpoint outside its output and links ``link`` to it."""
    return (
        JOB_HEADER
        + f"""
import shutil
elsewhere = pathlib.Path({str(elsewhere)!r})
if LINK == "checkpoint":
    os.symlink(elsewhere, out / "checkpoint")
else:  # the output directory itself
    shutil.move(str(out), str(elsewhere.parent / "moved"))
    os.symlink(elsewhere.parent / "moved", out)
    out = elsewhere.parent / "moved"
(out / "metrics.json").write_text("{{}}")
""".replace("LINK", repr(link))
    )


def tiny_checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=1, d_model=8, max_seq_len=16)
    save_checkpoint(GPT(config), config, path)


@pytest.mark.parametrize("link", ["checkpoint", "output"])
async def test_a_link_in_a_jobs_output_fails_the_run(
    world: World, tmp_path: Path, link: str
) -> None:
    elsewhere = tmp_path / "elsewhere" / "checkpoint"
    tiny_checkpoint(elsewhere)
    input = world.job_input()

    result = await ActivityEnvironment().run(
        world.activities(checkpoint_job(elsewhere, link=link)).run_job, input
    )

    assert result.status == "failed"
    assert result.error is not None and "symbolic link" in result.error
    assert world.run_row(input.run_id).status == "failed"


async def test_a_checkpoint_reached_through_a_link_is_not_installed(
    world: World, tmp_path: Path
) -> None:
    record_run(world, "r1")
    elsewhere = tmp_path / "elsewhere"
    tiny_checkpoint(elsewhere / "checkpoint")
    output = world.output_dir("r1")
    output.parent.mkdir(parents=True)
    os.symlink(elsewhere, output)  # output -> elsewhere: checkpoint/ is a regular dir there
    input = RegisterCheckpointInput(
        loop=world.loop,
        run_id="r1",
        checkpoint_dir_uri=(output / "checkpoint").as_uri(),  # not resolved: as train.py builds it
        parent_checkpoint_id=None,
    )
    activities = world.activities(JOB_HEADER)

    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(activities.register_checkpoint, input)

    assert raised.value.type == "CheckpointInvalid" and raised.value.non_retryable
    assert "symbolic link" in str(raised.value)
    assert not world.artifacts.checkpoint_dir("x").parent.exists()


def test_a_relative_state_directory_still_reads_job_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RATCHET_STATE_DIR=./state gives relative run paths: the link check takes them from the
    working directory, and a clean output is read as before."""
    from services.artifacts import ArtifactStore
    from services.loop.states import RunStatus
    from workflows.activities.finished_outputs import read_outputs

    monkeypatch.chdir(tmp_path)
    store = ArtifactStore(Path("state") / "artifacts")
    output = store.run_dir("loop", "run") / "output"
    output.mkdir(parents=True)
    (output / "metrics.json").write_text('{"loss": 0.5}')
    read = read_outputs(store.root, output, state=RunStatus.SUCCEEDED, error=None)
    assert (read.state, read.error, read.metrics) == (RunStatus.SUCCEEDED, None, {"loss": 0.5})
