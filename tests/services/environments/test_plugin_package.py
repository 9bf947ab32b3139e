"""A team's own environment as a package, and a trainer that is a plain script, in one loop.

``examples/arith-environment`` is pip-installed into a fresh directory (never into the test
venv), which is put on the path of this process and of every job: the registry finds it
through the ``ratchet.environments`` entry point alone. Then a loop on that environment
runs a whole cycle on the real Temporal dev server and Postgres with the real activities:
curation adapts traces with the package's ``task_from_trace``; the train job is
``examples/byo-trainer/train.py`` (standard library only, not Ratchet's trainer) set as
the loop's ``training_profile.train_job.command``; Ratchet's evaluator scores champion and
candidate with the package's verifier; the gate decides and the cycle closes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from temporalio.client import Client

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint, record_checkpoint
from services.db.models import Checkpoint, Cycle, Evaluation, Loop, Promotion, Run, Task
from services.db.queries.loops import LoopFields, create_loop
from services.db.session import SessionFactory
from services.environments import Environment, environment_names, get_environment
from services.environments.base import TRACE_SCHEMA, write_task_file
from services.environments.registry import refresh_installed
from services.settings import Settings
from tests.e2e.support import TINY_MODEL
from tests.services.curation.support import add_traces
from tests.services.training.conftest import write_spec
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import LoopInput
from workflows.worker import WorkerDependencies, build_worker

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "examples" / "arith-environment"
PLAIN_TRAINER = ROOT / "examples" / "byo-trainer" / "train.py"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example package installed into a directory of its own, as `pip install` does."""
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(PACKAGE),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    yield site


@pytest.fixture
def arith(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The package importable here and in every job this test's executor starts."""
    monkeypatch.syspath_prepend(str(plugin_site))
    path = os.pathsep.join(
        p for p in (str(plugin_site), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    monkeypatch.setenv("PYTHONPATH", path)
    refresh_installed()
    yield plugin_site
    refresh_installed()
    for name in [m for m in sys.modules if m.startswith("ratchet_example_arith")]:
        del sys.modules[name]


def test_an_installed_package_registers_its_environment(arith: Path) -> None:
    assert "arith" in environment_names()
    env = get_environment("arith")
    assert isinstance(env, Environment) and env.name == "arith"
    trace = {
        "schema": TRACE_SCHEMA,
        "external_id": "t1",
        "messages": [
            {"role": "user", "content": "what is 12 * 7?"},
            {"role": "assistant", "content": "ans 80"},
        ],
    }
    task = env.task_from_trace(trace)
    assert not hasattr(task, "reason"), task
    assert task.reference_answer == "84"  # recomputed, the trace's claim is not trusted
    episode = env.start(task, max_turns=2)
    env.step(task, episode, "ans 84")
    assert env.verify(task, episode).passed
    rejected = env.task_from_trace({**trace, "messages": [{"role": "user", "content": "hi"}]})
    assert getattr(rejected, "reason", None) == "no_arithmetic"


def test_unknown_and_broken_environments_are_clear_errors(
    arith: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"unknown environment 'chess' \(known: .*arith"):
        get_environment("chess")
    # Two broken packages: one whose module is missing, one whose object is no environment.
    site = tmp_path / "broken-site"
    info = site / "broken_envs-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[ratchet.environments]\nghost = no_such_module:Env\nplain = json:JSONDecoder\n"
    )
    monkeypatch.syspath_prepend(str(site))
    refresh_installed()
    assert {"arith", "ghost", "plain", "toolcalc"} <= set(environment_names())
    with pytest.raises(ValueError, match=r"'ghost' .* cannot be loaded: ModuleNotFoundError"):
        get_environment("ghost")
    with pytest.raises(ValueError, match="does not implement the Environment interface"):
        get_environment("plain")
    assert get_environment("arith").name == "arith"  # the others still work


def arith_traces(n: int, seed: int) -> list[dict[str, object]]:
    import random

    rng = random.Random(seed)
    traces = []
    for index in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        traces.append(
            {
                "schema": TRACE_SCHEMA,
                "external_id": f"arith-{seed}-{index}",
                "model_version": "m1",
                "messages": [
                    {"role": "user", "content": f"what is {a} + {b}?"},
                    {"role": "assistant", "content": f"ans {a + b + 1}"},
                ],
                "outcome": {"success": False, "score": 0.0, "error": {"kind": "wrong_answer"}},
                "metadata": {},
            }
        )
    return traces


def tiny_champion(work: Path) -> Path:
    """A first champion: the tiny model, SFT for a few steps on the package's tasks by the
    reference train job (which loads the environment through the same entry point)."""
    tasks = get_environment("arith").generate_tasks(32, seed=1)
    dataset = work / "sft.jsonl"
    write_task_file(dataset, tasks)
    spec = write_spec(
        work / "spec.json",
        kind="train",
        run_id="arith-champion",
        algorithm="sft",
        environment="arith",
        dataset=str(dataset),
        hyperparameters={"steps": 2, "batch_size": 4, "threads": 1, "model": TINY_MODEL},
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    done = subprocess.run(
        [sys.executable, "-m", "services", "job", "train", "--spec", str(spec)],
        env={**env, "RATCHET_OUTPUT_DIR": str(work / "output")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return work / "output" / "checkpoint"


@pytest.mark.slow
async def test_a_plugin_loop_with_a_plain_script_trainer_completes_a_cycle(
    arith: Path,
    temporal_client: Client,
    task_queue: str,
    session_factory: SessionFactory,
    tmp_path: Path,
) -> None:
    name = f"arith-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        state_dir=tmp_path / "state",
        artifact_root=tmp_path / "artifacts",
        executor="local",
        local_job_commands_enabled=True,  # the loop's train_job.command is a plain script
        temporal_task_queue=task_queue,
    )
    artifacts = ArtifactStore(settings.artifacts_dir)
    champion_dir = tiny_champion(tmp_path / "champion")
    with session_factory.begin() as session:
        loop = create_loop(
            session=session,
            fields=LoopFields(
                name=name,
                environment="arith",
                training_profile={
                    "device": "cpu",
                    "train_job": {"command": [sys.executable, str(PLAIN_TRAINER)]},
                },
                gate_policy={"canary_seconds": 0, "eval_samples": 1},
                trigger_policy={
                    "min_new_tasks": 4,
                    "check_interval_s": 0.2,
                    "drift_enabled": False,
                },
                curation_policy={"eval_fraction": 0.3, "heldout_fraction": 0.0},
                serving_target={"kind": "none"},
            ),
        )
        installed = install_checkpoint(champion_dir, artifacts)
        champion = record_checkpoint(
            session=session, installed=installed, loop_id=loop.id, parent_id=None, run_id=None
        )
        loop.champion_checkpoint_id = champion.id
        loop_id, champion_id = loop.id, champion.id
    add_traces(session_factory, loop_id, arith_traces(16, seed=3))

    deps = WorkerDependencies(
        settings=settings, session_factory=session_factory, artifacts=artifacts
    )
    async with build_worker(
        temporal_client, deps, task_queue=task_queue, max_concurrent_activities=8
    ):
        result = await temporal_client.execute_workflow(
            LoopWorkflow.run,
            LoopInput(loop=name, max_cycles=1),
            id=f"loop/{name}",
            task_queue=task_queue,
        )
    with session_factory() as session, session.no_autoflush:
        cycle = session.scalars(select(Cycle).where(Cycle.loop_id == loop_id)).one()
        runs = session.scalars(select(Run).where(Run.loop_id == loop_id)).all()
        (train,) = [r for r in runs if r.kind == "train"]
        candidates = session.scalars(
            select(Checkpoint).where(Checkpoint.loop_id == loop_id, Checkpoint.id != champion_id)
        ).all()
        evaluations = session.scalars(select(Evaluation).where(Evaluation.loop_id == loop_id)).all()
        decision = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).one()
        tasks = session.scalars(select(Task).where(Task.loop_id == loop_id)).all()
        loop_row = session.get(Loop, loop_id)
        assert loop_row is not None
        champion_now = loop_row.champion_checkpoint_id

    assert (result.cycles_done, result.last_outcome) == (1, cycle.outcome)
    assert cycle.outcome in ("promoted", "rejected"), cycle.outcome_detail
    assert {t.spec["environment"] for t in tasks} == {"arith"}
    # The plain script trained: its metrics are the run's, its checkpoint descends from the
    # champion and was verified against the manifest it wrote.
    assert train.status == "succeeded" and train.metrics["trainer"] == "plain-script"
    assert train.metrics["tasks_seen"] > 0
    (registered,) = candidates
    assert registered.parent_id == champion_id and registered.run_id == train.id
    assert registered.id == train.metrics["checkpoint_id"]
    # Ratchet's evaluator scored both on the same task set with the package's verifier.
    assert {(e.checkpoint_id, e.task_set) for e in evaluations} >= {
        (champion_id, "eval"),
        (registered.id, "eval"),
    }
    assert decision.decision in ("promote", "reject")
    assert champion_now == (registered.id if cycle.outcome == "promoted" else champion_id)
