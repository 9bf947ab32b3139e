"""A real LM learns from a foreign agent's traces: the loop on a domain Ratchet did not write.

    python benchmarks/foreign_agent.py                       # the bookshop example's month
    python benchmarks/foreign_agent.py --traces T.jsonl [--feedback F.jsonl] \\
        --tools "my-tools --stdio" [--change-at 2026-11-16T08:00:00Z]
    python benchmarks/foreign_agent.py --prepare-only        # the held-out sets, no loop

Any domain: ``--traces`` is ``ratchet.trace/v1`` JSONL (successes and failures of an agent,
its tools with their recorded results, reference answers), ``--feedback`` the verdicts that
came later (the feedback API's body plus ``external_id``), ``--tools`` a stdio MCP server of
the domain's tools, which the benchmark allow-lists in its own stack for the calls nobody
recorded. With none of them it generates the bookshop support agent's month
(``examples/support-agent``: 1000 traces by default, a tool change halfway) and serves its
tools with the example's MCP server.

Steps (``benchmarks/foreign_traffic.py`` holds the pure parts, ``benchmarks/foreign_loop.py``
the loop-driving ones):

1. hold out ``--heldout-share`` of the traces by cluster (curation's similarity); they are
   never posted. The held-out failures after the change are the **failure tasks** (drawn as
   the loop's eval tasks are); all held-out traces, at most ``--traffic-sample``, are the
   frozen **traffic sample**;
2. a ``ratchet up``-like stack (embedded Postgres and Temporal, api, worker, the local
   executor) listing the MCP server as a tool endpoint; SmolLM2-135M-Instruct in its store;
   a replay loop over it naming the endpoint, trained with rft (the SmolLM2 demo's settings,
   ``--hyper`` to change them);
3. the rest of the traces through the signed webhook, their feedback through the feedback
   API, curated by the loop;
4. ``ratchet loop bootstrap``: the first champion, SFT-LoRA on the train split's successes;
5. one cycle (``run-now``): rft with replay from the champion, the loop's own gate;
6. eval jobs (greedy, one episode per task) of the base model, the champion and the
   candidate on both held-out sets, paired by task.

Prints progress, then ONE JSON line: two steps apart, **bootstrap** (base → champion) and
**the cycle** (champion → candidate), each on the failure tasks and on the traffic sample
with counts, each side's Wilson 95% interval, the gain with the paired bootstrap's 95%
interval and exact McNemar p-values (``steps``); the headline keys ``bootstrap_gain_points``
(traffic sample), ``cycle_gain_points``, ``cycle_ci95`` and ``cycle_significant`` (failure
tasks, one-sided p < 0.05 as the gate), ``traffic_delta_points`` and
``traffic_loss_significant`` (traffic sample), ``heldout_tasks`` (failure tasks); the share of
passing episodes that made every needed tool call (``needed_calls``), ``unanswerable_calls``,
``loop_wall_s`` (posting, curation, bootstrap and the cycle: what the loop took; the bar's
hour), ``wall_s`` (everything, the benchmark's own evaluations included), ``cost_usd`` (the
loop's runs) and ``bar``: issue 41's conditions, each met or not.
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
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import foreign_loop as loop
from benchmarks.drift import shared_machine_figures
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
from services.curation.policy import CurationPolicy

logger = logging.getLogger("benchmarks.foreign_agent")

EVAL_SETTINGS = {"max_turns": 5, "max_new_tokens": 48, "batch_size": 32}
MODELS = ("base", "champion", "candidate")
SETS = ("failures", "traffic")


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
    if args.prepare_only:
        policy = CurationPolicy.from_json({"tool_endpoint": loop.TOOL_ENDPOINT})
        held = held_out(args, work, prepared, policy.replay_settings())
        return {**plan_figures(prepared, held), "prepared_only": True, "wall_s": _since(started)}
    command = prepared.traffic.tools_command
    assert command, "main() requires --tools with --traces"
    config = loop.tool_endpoint_config(command, loop.mcp_tool_names(command))
    missing = loop.missing_features(config)
    if missing:
        raise loop.HarnessError("this Ratchet cannot run the loop yet: " + "; ".join(missing))
    held, result = _run_loop(args, work, prepared, config)
    figures = {
        **plan_figures(prepared, held),
        **result,
        "wall_s": _since(started),
        **shared_machine_figures(args.threads, load_start),
    }
    figures["bar"] = bar(figures)
    return figures


def _run_loop(
    args: argparse.Namespace, work: Path, prepared: Prepared, config: dict[str, Any]
) -> tuple[HeldOut, dict[str, Any]]:
    """Steps 2 to 6 on the benchmark's own stack: the held-out sets (scored as the loop
    scores its tasks), and the loop's and the steps' figures."""
    profile = _training_profile(args)
    with loop.running_stack(work / "state", config) as bench:
        base = loop.install_base_model(bench, work / "cache")
        secret, curation = loop.create_loop(bench, loop.loop_policies(base, profile))
        held = held_out(args, work, prepared, CurationPolicy.from_json(curation).replay_settings())
        timings: dict[str, float] = {}
        clock = time.monotonic()
        posted = loop.post_traffic(bench, secret, prepared.hold.posted, prepared.traffic.feedback)
        curated = loop.wait_curated(bench, posted.accepted)
        timings["post_and_curate_s"], clock = _since(clock), time.monotonic()
        champion_id = loop.bootstrap(bench)
        timings["bootstrap_s"] = _since(clock)
        env = loop.eval_job_env(config)
        scored = {("base", s): _score(args, work, env, base.directory, held, s) for s in SETS}
        champion_dir = loop.checkpoint_dir(bench, champion_id)
        for s in SETS:
            scored["champion", s] = _score(args, work, env, champion_dir, held, s)
        cycle = loop.run_cycle(bench)
        timings["cycle_s"] = cycle.wall_s
        candidate_dir = loop.checkpoint_dir(bench, cycle.candidate_id)
        for s in SETS:
            scored["candidate", s] = _score(args, work, env, candidate_dir, held, s)
        cost = loop.loop_cost_usd(bench)
    return held, {
        **_step_figures(scored, seed=args.seed),
        "needed_calls": {
            f"{model}/{s}": needed_calls_share(scored[model, s].episodes, held.sets.needed_tools)
            for model in MODELS
            for s in SETS
        },
        "unanswerable_calls": loop.unanswerable_calls(list(scored.values())),
        "posted": asdict(posted),
        "curation": curated,
        "cycle": asdict(cycle),
        "champion_id": champion_id,
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "loop_wall_s": round(sum(timings.values()), 1),
        "cost_usd": round(cost, 4),
        "training_profile": profile,
        "eval_settings": EVAL_SETTINGS,
    }


def _score(
    args: argparse.Namespace,
    work: Path,
    env: dict[str, str],
    checkpoint: Path,
    held: HeldOut,
    which: str,
) -> loop.Scored:
    tasks = held.files.failures if which == "failures" else held.files.traffic
    name = f"{checkpoint.name[:12]}-{which}"
    logger.info("evaluating %s on the held-out %s", checkpoint.name[:12], which)
    return loop.evaluate(
        checkpoint,
        tasks,
        work / "evaluations" / name,
        env=env,
        settings=EVAL_SETTINGS,
        seed=args.seed,
        device=args.device,
    )


def _step_figures(scored: dict[tuple[str, str], loop.Scored], *, seed: int) -> dict[str, Any]:
    """Both steps on both sets, and the headline keys read from them."""
    steps = {
        step: {
            s: step_figures(scored[before, s].scores, scored[after, s].scores, seed=seed)
            for s in SETS
        }
        for step, before, after in (
            ("bootstrap", "base", "champion"),
            ("cycle", "champion", "candidate"),
        )
    }
    cycle, traffic = steps["cycle"]["failures"], steps["cycle"]["traffic"]
    return {
        "steps": steps,
        "bootstrap_gain_points": steps["bootstrap"]["traffic"]["gain_points"],
        "bootstrap_failures_gain_points": steps["bootstrap"]["failures"]["gain_points"],
        "bootstrap_significant": steps["bootstrap"]["traffic"]["significant_gain"],
        "cycle_gain_points": cycle["gain_points"],
        "cycle_ci95": cycle["ci95_points"],
        "cycle_significant": cycle["significant_gain"],
        "traffic_delta_points": traffic["gain_points"],
        "traffic_ci95": traffic["ci95_points"],
        "traffic_loss_significant": traffic["significant_loss"],
    }


def _training_profile(args: argparse.Namespace) -> dict[str, Any]:
    from services.demo.smollm2 import training_profile

    profile = training_profile()
    profile["hyperparameters"] = {**profile["hyperparameters"], **dict(args.hyper)}
    profile["device"] = args.device
    return profile


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--traces", type=Path, default=None, help="ratchet.trace/v1 JSONL")
    p.add_argument("--feedback", type=Path, default=None, help="feedback JSONL (with --traces)")
    p.add_argument("--tools", default=None, help="the domain's stdio MCP server command")
    p.add_argument(
        "--change-at", type=_when, default=None, help="when the tools changed (ISO time)"
    )
    p.add_argument("--seed", type=int, default=0, help="the hold-out's, the example's, the jobs'")
    p.add_argument("--count", type=int, default=1000, help="traces of the example's month")
    p.add_argument("--heldout-share", type=fraction, default=0.25, help="clusters held out")
    p.add_argument("--traffic-sample", type=int, default=100, help="held-out traffic tasks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="recorded with the load")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--hyper",
        type=_hyperparameter,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an rft hyperparameter over the SmolLM2 demo's (repeatable)",
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        figures = run(args)
    except (TrafficError, loop.HarnessError, ValueError) as exc:
        print(f"foreign_agent: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
