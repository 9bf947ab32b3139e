"""What several benchmarks share: the api as its own process, as production does, a database
with a loop, checkpoints to serve, the paired comparison, and the task sets and options of the
SmolLM2 drift-recovery runs. Torch-free at import (the ingest and curation benchmarks do not
need it)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import psycopg

from services.db.migrate import upgrade
from services.db.queries.loops import LoopFields
from services.db.session import create_db_engine, make_session_factory
from services.environments.base import Environment, TaskSpec
from services.evaluation.stats import PairedComparison, compare_paired
from services.ingest.provisioning import ProvisionedLoop, provision_loop
from services.secrets import SecretBox, generate_key
from services.serving.base import CheckpointRef

if TYPE_CHECKING:
    from services.evaluation.evaluator import EvaluationResult

REPO = Path(__file__).resolve().parents[1]
BENCH_SECRET_KEY = generate_key()  # encrypts the loop's signing secret (services.secrets)


def random_tiny_checkpoints(root: Path, count: int) -> list[CheckpointRef]:
    """``count`` checkpoints of the reference policy's shape under ``root``, each with its own
    random weights (so its own checkpoint id): versions for a serving target to swap between."""
    import torch

    from services.training.checkpoint import save_checkpoint
    from services.training.tiny.model import GPT, GPTConfig

    config = GPTConfig()
    refs = []
    for seed in range(count):
        torch.manual_seed(seed)
        path = root / f"tiny-{seed}"
        manifest = save_checkpoint(GPT(config), config, path)
        refs.append(CheckpointRef(id=manifest.checkpoint_id, uri=path.as_uri()))
    return refs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_api_process(
    database_url: str, port: int, env: Mapping[str, str], *, repo: Path = REPO
) -> subprocess.Popen[bytes]:
    """``ratchet api`` of the checkout at ``repo`` on 127.0.0.1:``port``, with ``env`` and the
    settings every benchmark gives it; returned once it answers /healthz, so that no benchmark
    times the start."""
    env = {
        **env,
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_API_HOST": "127.0.0.1",
        "RATCHET_API_PORT": str(port),
        "RATCHET_ADMIN_TOKEN": "bench",
        "RATCHET_SECRET_KEY": BENCH_SECRET_KEY,
        "RATCHET_LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services", "api"], cwd=repo, env=env, stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the api exited with code {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the api did not start within 60 s")


class Postgres(Protocol):
    """What the benchmarks use of a ``pgserver`` server (imported lazily: a test extra)."""

    def get_uri(self, database: str) -> str: ...

    def get_pid(self) -> int | None: ...


@contextmanager
def temporary_postgres(prefix: str) -> Iterator[tuple[Postgres, Path]]:
    """A Postgres of the benchmark's own (pgserver) and a scratch directory beside it, both
    gone afterwards, so a run measures a fresh database and leaves nothing behind."""
    import pgserver

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = pgserver.get_server(Path(tmp) / "pg", cleanup_mode="stop")
        try:
            yield server, Path(tmp)
        finally:
            server.cleanup()


def create_loop_database(server: Postgres, loop: str) -> tuple[str, ProvisionedLoop]:
    """A migrated ``ratchet_bench`` database on ``server`` holding one toolcalc loop named
    ``loop``; returns the database's URL and the loop's credentials, so that a benchmark posts
    traces as a real client would."""
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        conn.execute("CREATE DATABASE ratchet_bench")
    database_url = server.get_uri("ratchet_bench")
    upgrade(database_url)
    engine = create_db_engine(database_url, pool_size=1)
    try:
        with make_session_factory(engine).begin() as session:
            created = provision_loop(
                session,
                fields=LoopFields(name=loop, environment="toolcalc"),
                box=SecretBox.from_keys(BENCH_SECRET_KEY),
            )
    finally:
        engine.dispose()
    return database_url, created


@dataclass(frozen=True)
class LoopApi:
    """A benchmark's own Postgres holding one loop, and ``ratchet api`` in front of it."""

    server: Postgres
    database_url: str
    loop: ProvisionedLoop
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop_api(self) -> None:
        """Stop the api; the database stays up (to measure Postgres alone afterwards)."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@contextmanager
def api_over_loop(
    prefix: str, loop: str, env: Mapping[str, str], *, repo: Path = REPO
) -> Iterator[LoopApi]:
    """What an ingest benchmark posts to: a fresh Postgres with loop ``loop`` and the api of
    the checkout at ``repo`` with ``env``, all gone afterwards."""
    with temporary_postgres(prefix) as (server, _):
        database_url, created = create_loop_database(server, loop)
        port = free_port()
        stack = LoopApi(
            server,
            database_url,
            created,
            port,
            start_api_process(database_url, port, env, repo=repo),
        )
        try:
            yield stack
        finally:
            stack.stop_api()


def held_out(
    env: Environment,
    version: str,
    n: int,
    seed: int,
    exclude: set[str],
    *,
    keep: Callable[[TaskSpec], bool] | None = None,
) -> list[TaskSpec]:
    """``n`` tasks of API ``version`` that no training set in ``exclude`` holds (and that
    ``keep`` accepts)."""
    pool = env.generate_tasks(3 * n + len(exclude), seed=seed, api_version=version)
    return [t for t in pool if t.task_id not in exclude and (keep is None or keep(t))][:n]


# What each toolcalc drift changes that a real LM cannot read off the renamed tool list:
# v2 only renames (so every task counts), v3 adds the required ``cur`` to the price lookup,
# which only tasks with a ``$item`` call (half the generated families) meet.
DRIFT_CHANGED_OPS: dict[str, frozenset[str] | None] = {"v2": None, "v3": frozenset({"lookup"})}


def touched_by_drift(drift: str) -> Callable[[TaskSpec], bool]:
    """Whether solving a task calls a tool that ``drift`` changed (its held-out set)."""
    from services.environments.toolcalc import get_api
    from services.environments.toolcalc.tasks import solve

    changed, api = DRIFT_CHANGED_OPS[drift], get_api(drift)

    def touched(task: TaskSpec) -> bool:
        program = solve(str(task.verifier["params"]["request"]), api)
        return changed is None or any(op in changed for op, _ in program.calls)

    return touched


@dataclass(frozen=True)
class DriftTaskSets:
    """The task sets of a drift-recovery run on a real LM, disjoint by task id: v1
    demonstrations for the champion, drifted tasks that call the changed tool for GRPO, a
    held-out set of each API version, and v1 replay tasks (a loop's regression split: v1
    traffic the champion handled, none of it held out), which rft replays."""

    sft: list[TaskSpec]
    grpo: list[TaskSpec]
    eval_v1: list[TaskSpec]
    eval_drifted: list[TaskSpec]
    replay: list[TaskSpec]


def drift_task_sets(
    env: Environment,
    drift: str,
    *,
    sft: int,
    grpo: int,
    evaluation: int,
    seed: int,
    replay: int = 32,
) -> DriftTaskSets:
    """The sets every SmolLM2 benchmark trains and scores on, so their figures compare."""
    sft_tasks = env.generate_tasks(sft, seed=seed + 1, api_version="v1")
    touched = touched_by_drift(drift)
    grpo_pool = env.generate_tasks(3 * grpo, seed=seed + 2, api_version=drift)
    grpo_tasks = [t for t in grpo_pool if touched(t)][:grpo]
    seen = {t.task_id for t in sft_tasks} | {t.task_id for t in grpo_tasks}
    eval_v1 = held_out(env, "v1", evaluation, seed + 3, seen)
    eval_drifted = held_out(env, drift, evaluation, seed + 4, seen, keep=touched)
    scored = seen | {t.task_id for t in eval_v1 + eval_drifted}
    return DriftTaskSets(
        sft=sft_tasks,
        grpo=grpo_tasks,
        eval_v1=eval_v1,
        eval_drifted=eval_drifted,
        replay=held_out(env, "v1", replay, seed + 5, scored),
    )


def smollm2_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every SmolLM2 benchmark takes (a benchmark adds its own after them)."""
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the converted SmolLM2 checkpoint is cached (default: <workdir>/smollm2)",
    )


def paired_on(
    tasks: Sequence[TaskSpec], champion: EvaluationResult, candidate: EvaluationResult, *, seed: int
) -> PairedComparison:
    """Candidate against champion task by task on ``tasks``, at the gate's confidence."""
    ids = [t.task_id for t in tasks]
    return compare_paired(
        [champion.passes()[i] for i in ids],
        [candidate.passes()[i] for i in ids],
        confidence=0.95,
        seed=seed,
    )


def drift_recovery_figures(
    champion: tuple[EvaluationResult, EvaluationResult],
    candidate: tuple[EvaluationResult, EvaluationResult],
) -> dict[str, float]:
    """The headline figures of a drift-recovery run, named alike in every trainer benchmark:
    each model's (v1, v2) pass rates, the v1 regression and the v2 gain in points."""
    (v1_before, v2_before), (v1_after, v2_after) = champion, candidate
    return {
        "v1_pass_champion": v1_before.pass_rate,
        "v2_pass_before": v2_before.pass_rate,
        "v2_pass_after": v2_after.pass_rate,
        "v1_pass_after": v1_after.pass_rate,
        "v1_regression_drop_points": round(100.0 * (v1_before.pass_rate - v1_after.pass_rate), 2),
        "v2_gain_points": round(100.0 * (v2_after.pass_rate - v2_before.pass_rate), 2),
    }


def shared_machine_figures(
    threads: int | None, load_start: tuple[float, float, float]
) -> dict[str, Any]:
    """What the machine was doing around a run (threads used, CPUs, load average before and
    after), printed with every trainer benchmark's figures: machines here are shared, and a
    figure is read against its load."""
    return {
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
