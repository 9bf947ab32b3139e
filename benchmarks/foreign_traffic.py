"""The foreign-agent benchmark's pure parts: a domain's traffic, held out by cluster, its
held-out sets as replay tasks, and the figures of a step.

Nothing here starts a process or opens a database (``benchmarks/foreign_loop.py`` drives the
stack): what decides which traces the loop never sees, and how a step is judged, is tested
on its own (``tests/benchmarks/test_foreign_agent.py``).

- **Traffic** is any domain's ``ratchet.trace/v1`` JSONL, oldest first, with an optional
  JSONL of feedback that came later (the feedback API's body plus the ``external_id`` it
  names); by default the bookshop example's generated month (``examples/support-agent``).
- **Hold-out by cluster**, with curation's own notion of alike (``services.curation``): a
  trace's prompt is its replay task's (the system and user messages before the first
  assistant turn); two traces are linked when they share an LSH band and their
  MinHash-estimated Jaccard similarity is at least the cluster threshold (0.8, curation's
  default): the pairs curation itself would compare and link. Clusters are the connected
  components of every such link, near duplicates' included, so they contain any cluster
  curation could form from the same traces in any order. A cluster is held out when the
  hash of the seed and its id falls below the share, so a seed picks its own clusters and no
  cluster spans both sides.
- **Held-out sets**: the *failure tasks* are the held-out traces that failed (their
  feedback's verdict first, else ``outcome.success``) at or after the change (``--change-at``;
  the example's manifest says when its tools changed), as the loop's eval tasks would be
  drawn; the *traffic sample* is the frozen held-out traffic of every kind and both eras, at
  most ``traffic_sample`` tasks. Both are replay tasks built as curation builds them (the
  trace's feedback and the loop's reward settings under the ``ratchet`` key), answered by
  the recorded calls of the posted traces (the store the loop would ship) and the domain's
  MCP server for the rest.
- **A step's figures** (base → champion, champion → candidate), on one task set, paired:
  each side's pass rate with its Wilson 95% interval, the gain in points with the paired
  bootstrap's 95% interval, and exact McNemar tests (one-sided each way, as the gate reads
  them; ``services.evaluation.stats``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from services.curation.similarity import Signature, band_keys, jaccard_many, signature, stack
from services.curation.splits import cluster_fraction
from services.environments.base import Rejection, TaskSpec, write_task_file
from services.environments.replay.env import ReplayEnvironment, prompt_text
from services.environments.replay.records import recorded_calls, write_store_file
from services.environments.replay.rewards import feedback_is_positive
from services.evaluation.stats import compare_paired, mcnemar_exact_one_sided, mean_interval
from services.ingest.schema import TraceV1

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "support-agent"
FEEDBACK_FIELDS = frozenset({"external_id", "id", "score", "label", "correction", "comment"})
CONFIDENCE = 0.95
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class TrafficError(ValueError):
    """Traffic that cannot be read: the file, the line and the field at fault."""


@dataclass(frozen=True)
class Traffic:
    """A domain's traces (oldest first), the feedback that came later by trace, when its
    tools changed (None: the failures of every era are held-out failure tasks), and the
    stdio MCP server command of its tools."""

    traces: list[dict[str, Any]]
    feedback: dict[str, dict[str, Any]] = field(default_factory=dict)
    change_at: datetime | None = None
    tools_command: list[str] | None = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file; a bad line is a :class:`TrafficError` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrafficError(f"cannot read {path}: {exc}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise TrafficError(f"{path}: line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise TrafficError(f"{path}: line {number}: not a JSON object")
        rows.append(row)
    return rows


def read_traffic(
    traces_path: Path,
    feedback_path: Path | None = None,
    *,
    change_at: datetime | None = None,
    tools_command: list[str] | None = None,
) -> Traffic:
    """A domain's files, checked as the webhook and the feedback API would check them."""
    traces = read_jsonl(traces_path)
    if not traces:
        raise TrafficError(f"{traces_path} holds no trace")
    seen: set[str] = set()
    for number, trace in enumerate(traces, start=1):
        try:
            TraceV1.model_validate(trace)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "(trace)"
            raise TrafficError(
                f"{traces_path}: trace {number}: {where}: {error['msg']} (the webhook refuses it)"
            ) from None
        if trace["external_id"] in seen:
            raise TrafficError(f"{traces_path}: trace {number}: external_id repeats an earlier one")
        seen.add(trace["external_id"])
    feedback = _read_feedback(feedback_path, seen) if feedback_path is not None else {}
    return Traffic(traces, feedback, change_at, tools_command)


def _read_feedback(path: Path, external_ids: set[str]) -> dict[str, dict[str, Any]]:
    feedback: dict[str, dict[str, Any]] = {}
    for number, row in enumerate(read_jsonl(path), start=1):
        unknown = sorted(set(row) - FEEDBACK_FIELDS)
        if unknown:
            raise TrafficError(f"{path}: line {number}: unknown field(s) {unknown}")
        if row.get("external_id") not in external_ids:
            raise TrafficError(f"{path}: line {number}: external_id names no trace of the file")
        if all(row.get(key) is None for key in ("score", "label", "correction")):
            raise TrafficError(f"{path}: line {number}: needs a score, a label or a correction")
        feedback[row["external_id"]] = {k: v for k, v in row.items() if k != "external_id"}
    return feedback


def example_traffic(out_dir: Path, *, seed: int, count: int) -> Traffic:
    """The bookshop example's month (``examples/support-agent/traffic.py``), written under
    ``out_dir`` and read back as any domain's files are; with its change and MCP server."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    generator = importlib.import_module("traffic")
    generated = generator.generate(seed=seed, count=count)
    generator.write(generated, out_dir)
    command = [sys.executable, str(EXAMPLE / "mcp_server.py"), "--seed", str(seed)]
    return read_traffic(
        out_dir / "traces.jsonl",
        out_dir / "feedback.jsonl",
        change_at=generated.change_at,
        tools_command=command,
    )


def conversation_prompt(trace: Mapping[str, Any]) -> str:
    """The text curation compares: the replay task's prompt (the messages before the first
    assistant turn, one ``role: content`` line each)."""
    messages = [m for m in trace.get("messages") or () if isinstance(m, Mapping)]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    return prompt_text(messages[:first])


@dataclass(frozen=True)
class HoldOut:
    """Traces split by cluster: the ones posted and the ones the loop never sees."""

    posted: list[dict[str, Any]]
    heldout: list[dict[str, Any]]
    cluster_of: dict[str, str]  # external_id -> cluster id
    heldout_clusters: frozenset[str]

    @property
    def clusters(self) -> int:
        return len(set(self.cluster_of.values()))


def hold_out_by_cluster(
    traces: Sequence[Mapping[str, Any]],
    *,
    share: float,
    seed: int,
    cluster_threshold: float = 0.8,
) -> HoldOut:
    """Hold out about ``share`` of the clusters (see the module docstring)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"the held-out share must be between 0 and 1, got {share}")
    ids = [str(t["external_id"]) for t in traces]
    roots = _components([signature(conversation_prompt(t)) for t in traces], cluster_threshold)
    cluster_of = {ext: _key(ids[root]) for ext, root in zip(ids, roots, strict=True)}
    held = frozenset(c for c in set(cluster_of.values()) if cluster_fraction(f"{seed}/{c}") < share)
    posted = [dict(t) for t in traces if cluster_of[str(t["external_id"])] not in held]
    heldout = [dict(t) for t in traces if cluster_of[str(t["external_id"])] in held]
    return HoldOut(posted, heldout, cluster_of, held)


def _components(signatures: Sequence[Signature], threshold: float) -> list[int]:
    """Each signature's component (the index of its first member): two are linked when they
    share an LSH band and their estimated Jaccard similarity is at least ``threshold``,
    curation's candidate pairs and test (``services.curation.similarity``)."""
    parent = list(range(len(signatures)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    for index, sig in enumerate(signatures):
        for band in band_keys(sig):
            buckets[band].append(index)
    rows = stack(signatures)
    for members in buckets.values():
        for position, index in enumerate(members[:-1]):
            later = members[position + 1 :]
            for other, sim in zip(later, jaccard_many(rows[index], rows[later]), strict=True):
                if sim >= threshold:
                    low, high = sorted((find(index), find(other)))
                    parent[high] = low
    return [find(i) for i in range(len(signatures))]


def _key(external_id: str) -> str:
    return hashlib.sha256(external_id.encode("utf-8")).hexdigest()


def failed(trace: Mapping[str, Any], feedback: Mapping[str, Any] | None) -> bool | None:
    """Whether a trace failed: its feedback's verdict first (as curation reads it), else
    its outcome; None when neither says."""
    verdict = feedback_is_positive(feedback) if feedback is not None else None
    if verdict is not None:
        return not verdict
    success = (trace.get("outcome") or {}).get("success")
    return None if success is None else not success


def replay_task(
    env: ReplayEnvironment,
    trace: Mapping[str, Any],
    feedback: Mapping[str, Any] | None,
    policy_settings: Mapping[str, Any],
) -> TaskSpec | Rejection:
    """The replay task curation would make of the trace (its feedback and the loop's reward
    settings under the ``ratchet`` key, as ``services.curation.replay`` passes them)."""
    context = {"policy": dict(policy_settings), "feedback": _feedback_context(feedback)}
    return env.task_from_trace({**trace, "ratchet": context})


def _feedback_context(feedback: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if feedback is None:
        return None
    return {key: feedback.get(key) for key in ("score", "label", "correction", "comment")}


@dataclass(frozen=True)
class HeldOutSets:
    """The held-out failure tasks and the frozen traffic sample, as replay tasks."""

    failures: list[TaskSpec]
    traffic: list[TaskSpec]
    rejected: dict[str, int]  # held-out traces no task could be made of, by reason
    needed_tools: dict[str, list[str]]  # task id -> the tools a right answer calls, if known


def heldout_sets(
    hold: HoldOut,
    traffic: Traffic,
    *,
    policy_settings: Mapping[str, Any],
    traffic_sample: int,
    seed: int,
) -> HeldOutSets:
    """The two held-out sets (see the module docstring); tasks of equal content once."""
    env = ReplayEnvironment()
    failures: dict[str, TaskSpec] = {}
    every: dict[str, TaskSpec] = {}
    rejected: Counter[str] = Counter()
    needed: dict[str, list[str]] = {}
    for trace in hold.heldout:
        feedback = traffic.feedback.get(str(trace["external_id"]))
        task = replay_task(env, trace, feedback, policy_settings)
        if isinstance(task, Rejection):
            rejected[task.reason] += 1
            continue
        every.setdefault(task.task_id, task)
        if (tools := needed_tools(trace, feedback)) is not None:
            needed.setdefault(task.task_id, tools)
        if failed(trace, feedback) and _after(trace, traffic.change_at):
            failures.setdefault(task.task_id, task)
    sample = sorted(every.values(), key=lambda t: _key(f"{seed}/{t.task_id}"))[:traffic_sample]
    return HeldOutSets(list(failures.values()), sample, dict(rejected), needed)


def _after(trace: Mapping[str, Any], change_at: datetime | None) -> bool:
    if change_at is None:
        return True
    started = trace.get("started_at")
    if not isinstance(started, str):
        return False
    when = datetime.fromisoformat(started)
    return (when if when.tzinfo else when.replace(tzinfo=UTC)) >= change_at


def needed_tools(trace: Mapping[str, Any], feedback: Mapping[str, Any] | None) -> list[str] | None:
    """The tools a right answer to the trace calls: ``metadata.needed_tools`` when the
    domain says; else, for a success, the tools it called that answered without an error;
    else unknown (None)."""
    declared = (trace.get("metadata") or {}).get("needed_tools")
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return sorted(set(declared))
    if failed(trace, feedback) is not False:
        return None
    answered = [
        c.tool for c in recorded_calls(trace) if not c.result.lstrip().lower().startswith("error")
    ]
    return sorted(set(answered)) or None


@dataclass(frozen=True)
class HeldOutFiles:
    """The held-out sets as task files, beside the store the posted traces recorded."""

    failures: Path
    traffic: Path
    tool_store: Path


def write_heldout_files(
    sets: HeldOutSets, posted: Sequence[Mapping[str, Any]], directory: Path
) -> HeldOutFiles:
    """``heldout_failures.jsonl``, ``heldout_traffic.jsonl`` and ``tool_responses.jsonl``
    (every call the posted traces recorded: what the loop's store holds) under
    ``directory``; each task names the store as a dataset's tasks do."""
    directory.mkdir(parents=True, exist_ok=True)
    store = directory / "tool_responses.jsonl"
    write_store_file(store, [call for trace in posted for call in recorded_calls(trace)])
    files = HeldOutFiles(
        directory / "heldout_failures.jsonl", directory / "heldout_traffic.jsonl", store
    )
    for path, tasks in ((files.failures, sets.failures), (files.traffic, sets.traffic)):
        write_task_file(path, [_with_store(task, store) for task in tasks])
    return files


def _with_store(task: TaskSpec, store: Path) -> TaskSpec:
    lineage = {**dict(task.metadata.get("ratchet") or {}), "tool_store": str(store)}
    return dataclasses.replace(task, metadata={**task.metadata, "ratchet": lineage})


def step_figures(
    before: Mapping[str, float], after: Mapping[str, float], *, seed: int = 0
) -> dict[str, Any]:
    """One step on one task set, paired by task: counts, each side's rate with its Wilson
    95% interval, the gain in points with the paired bootstrap's 95% interval, and exact
    McNemar p-values for a gain and for a loss (one-sided, as the gate reads them)."""
    if set(before) != set(after):
        missing = sorted(set(before) ^ set(after))
        raise ValueError(f"a step compares the same tasks; {len(missing)} are on one side only")
    ids = sorted(before)
    first, second = [before[i] for i in ids], [after[i] for i in ids]
    paired = compare_paired(first, second, confidence=CONFIDENCE, seed=seed)
    alpha = 1.0 - CONFIDENCE
    p_loss = mcnemar_exact_one_sided(paired.only_candidate, paired.only_champion)
    return {
        "n": paired.n,
        "before": _rate(first),
        "after": _rate(second),
        "gain_points": round(paired.delta_points, 2),
        "ci95_points": [round(100 * paired.ci_low, 2), round(100 * paired.ci_high, 2)],
        "improved": paired.only_candidate,
        "regressed": paired.only_champion,
        "p_gain": paired.p_value_improvement,
        "p_loss": p_loss,
        "significant_gain": paired.p_value_improvement < alpha,
        "significant_loss": p_loss < alpha,
    }


def _rate(scores: Sequence[float]) -> dict[str, Any]:
    low, high = mean_interval(scores, CONFIDENCE)
    return {
        "passed": round(sum(scores), 3),
        "rate": round(sum(scores) / len(scores), 4),
        "wilson95": [round(low, 4), round(high, 4)],
    }


def calls_made(text: str, tools: Sequence[str]) -> set[str]:
    """The tools an episode called, read from its ``<tool_call>`` blocks."""
    names = set()
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in tools:
            names.add(str(call["name"]))
    return names


def needed_calls_share(
    episodes: Sequence[Mapping[str, Any]], needed: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """Of the passing episodes whose task says which tools it needs, the share that called
    every one (a pass by a guess is a pass the loop should not be proud of)."""
    passing = [e for e in episodes if e.get("passed") and e.get("task_id") in needed]
    complete = sum(
        set(needed[str(e["task_id"])])
        <= calls_made(str(e.get("text") or ""), needed[str(e["task_id"])])
        for e in passing
    )
    return {
        "passing_episodes": len(passing),
        "made_every_needed_call": complete,
        "share": round(complete / len(passing), 4) if passing else None,
    }


# The bar (issue 41, item 4).
BAR_HELDOUT_TASKS = 50
BAR_CYCLE_GAIN_POINTS = 15.0
BAR_TRAFFIC_DROP_POINTS = 2.0
BAR_LOOP_WALL_S = 3600.0  # posting, curation, bootstrap and the cycle


def bar(figures: Mapping[str, Any]) -> dict[str, bool]:
    """Each condition of the bar, met or not, read from the benchmark's figures (a cycle
    that did not run, its keys None, meets none of its conditions)."""
    gain, delta = figures["cycle_gain_points"], figures["traffic_delta_points"]
    checks = {
        "heldout_tasks": figures["heldout_tasks"] >= BAR_HELDOUT_TASKS,
        "cycle_gain": gain is not None and gain >= BAR_CYCLE_GAIN_POINTS,
        "cycle_significant": bool(figures["cycle_significant"]),
        "traffic_no_significant_loss": figures["traffic_loss_significant"] is False,
        "traffic_drop": delta is not None and delta >= -BAR_TRAFFIC_DROP_POINTS,
        "hour": figures["loop_wall_s"] <= BAR_LOOP_WALL_S,
    }
    return {**checks, "met": all(checks.values())}
