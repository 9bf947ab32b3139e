"""After a replay job: the live tool answers it got go into the loop's tool-response store,
and the tasks nobody could answer are set aside (docs/environments.md, "Tools the trace
never called").

What the job's sandbox wrote (services.environments.replay.sandbox) is job output, trusted
only as far as its ``metrics.json`` vouches for it, as episodes are
(services.curation.demonstrations):

- **live answers**: ``tool_answers.jsonl`` is read only when its listing (``tool_answers``:
  file, bytes, sha256, count) matches it byte for byte, and stored only when every line is a
  well-formed call of a tool on the loop's endpoint's allow-list, under a schema hash a tool
  of the run's tasks has. Anything else stores nothing and puts the reason on the run
  (``runs.error``), while the run's own outcome stands. Stored answers join the loop's store
  (``tool_responses``, a key already there keeps its first result), so the next snapshot
  ships them and its rollouts replay them instead of calling the endpoint again.
- **unanswerable calls**: each task of the run (the run's dataset, else the loop) that
  ``unanswerable_calls`` says hit a call nobody could answer in every one of its episodes
  (at least :data:`MIN_EPISODES_TO_SET_ASIDE`) is set aside with the reason
  ``unanswerable_calls`` (services.db.queries.task_set_aside): the
  snapshot leaves it out of the train split, and ``ratchet tasks`` shows why.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.chat.text import load_job_json
from services.db.models import Loop, Run
from services.db.queries.replay import record_tool_responses, tool_schemas
from services.db.queries.task_set_aside import UNANSWERABLE_CALLS, set_aside_tasks
from services.db.queries.tasks import row_ids_by_job_task_id
from services.environments.replay.records import (
    RecordedCall,
    StoreFileError,
    schema_hash,
)
from services.environments.replay.sandbox import ANSWERS_KEY, TOOL_ANSWERS_FILE, UNANSWERABLE_KEY
from services.evaluation.results import read_job_output
from services.settings import ToolEndpoint

logger = logging.getLogger(__name__)

MAX_ANSWERS_BYTES = 32 << 20  # bounds what the worker reads from one job
MAX_REPORTED_TASKS = 100_000
# A task is set aside on at least this many episodes of one run, all of which hit an
# unanswerable call: one sample's unlucky call says little about the task.
MIN_EPISODES_TO_SET_ASIDE = 2


class ToolOutcomeError(ValueError):
    """Job output its listing does not vouch for, or that the loop's terms refuse."""


@dataclass(frozen=True)
class ToolOutcomes:
    """What recording a run's sandbox outcomes did."""

    answers_stored: int = 0
    set_aside: tuple[int, ...] = ()


def record_job_tool_outcomes(
    session: Session,
    *,
    run: Run,
    output_dir: Path,
    metrics: Mapping[str, Any],
    tool_endpoints: Mapping[str, ToolEndpoint],
) -> ToolOutcomes:
    """Record a finished run's live answers and set aside its hopeless tasks (see the
    module); a part the job's output does not vouch for records nothing and says why on
    ``run.error``."""
    if ANSWERS_KEY not in metrics and UNANSWERABLE_KEY not in metrics:
        return ToolOutcomes()
    stored = 0
    set_aside: list[int] = []
    try:
        stored = _record_answers(session, run, output_dir, metrics, tool_endpoints)
    except ToolOutcomeError as exc:
        _note(run, f"tool answers rejected, none stored: {exc}")
    try:
        set_aside = _set_aside_unanswerable(session, run, metrics)
    except ToolOutcomeError as exc:
        _note(run, f"unanswerable_calls rejected, no task set aside: {exc}")
    if stored or set_aside:
        logger.info(
            "run %s: %d live tool answers stored; %d tasks set aside (unanswerable calls)",
            run.id,
            stored,
            len(set_aside),
        )
    return ToolOutcomes(answers_stored=stored, set_aside=tuple(set_aside))


# -- live answers ----------------------------------------------------------------------


def _record_answers(
    session: Session,
    run: Run,
    output_dir: Path,
    metrics: Mapping[str, Any],
    tool_endpoints: Mapping[str, ToolEndpoint],
) -> int:
    if ANSWERS_KEY not in metrics:
        return 0
    calls = read_listed_tool_answers(output_dir, metrics)
    if not calls:
        return 0
    allowed = _allow_list(session.get(Loop, run.loop_id), tool_endpoints)
    off_list = sorted({call.tool for call in calls} - allowed)
    if off_list:
        raise ToolOutcomeError(
            f"answers of tool(s) {off_list[:3]} that the loop's endpoint does not allow-list"
        )
    versions = _tool_versions(session, run)
    unknown = sorted({(c.tool, c.schema_hash) for c in calls} - versions)
    if unknown:
        tool, version = unknown[0]
        raise ToolOutcomeError(
            f"an answer of tool {tool} under schema {version}, which no task of the run has"
        )
    record_tool_responses(session=session, loop_id=run.loop_id, rows=[(c, None) for c in calls])
    return len(calls)


def read_listed_tool_answers(output_dir: Path, metrics: Mapping[str, Any]) -> list[RecordedCall]:
    """The live answers a job's ``metrics.json`` lists, read as far as the listing vouches
    (name, bytes, sha256, count); :class:`ToolOutcomeError` names what does not match."""
    listing = metrics.get(ANSWERS_KEY)
    if not isinstance(listing, Mapping) or listing.get("file") != TOOL_ANSWERS_FILE:
        raise ToolOutcomeError(f"metrics.{ANSWERS_KEY} must list the file {TOOL_ANSWERS_FILE!r}")
    size, count = _count(listing, "bytes"), _count(listing, "count")
    if size > MAX_ANSWERS_BYTES:
        raise ToolOutcomeError(f"metrics.{ANSWERS_KEY}.bytes is over {MAX_ANSWERS_BYTES}")
    path = output_dir / TOOL_ANSWERS_FILE
    try:
        data = read_job_output(path, limit=MAX_ANSWERS_BYTES).encode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolOutcomeError(f"cannot read {path}: {exc}") from None
    if len(data) != size:
        raise ToolOutcomeError(f"{path} has {len(data)} bytes, its listing says {size}")
    if hashlib.sha256(data).hexdigest() != listing.get("sha256"):
        raise ToolOutcomeError(f"{path} does not match the sha256 its listing gives")
    calls: list[RecordedCall] = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            call = RecordedCall.from_dict(load_job_json(line))  # job output: storable text
        except (ValueError, RecursionError, StoreFileError) as exc:
            raise ToolOutcomeError(f"{TOOL_ANSWERS_FILE} line {number}: {exc}") from None
        if not call.tool or len(call.tool) > 64 or len(call.schema_hash) != 16:
            raise ToolOutcomeError(f"{TOOL_ANSWERS_FILE} line {number}: not a tool call's key")
        calls.append(call)
    if len(calls) != count:
        raise ToolOutcomeError(f"{path} holds {len(calls)} answers, its listing says {count}")
    return calls


def _allow_list(loop: Loop | None, tool_endpoints: Mapping[str, ToolEndpoint]) -> set[str]:
    """The tools the loop's live endpoint may be asked, by the deployment's settings now."""
    name = (loop.curation_policy or {}).get("tool_endpoint") if loop is not None else None
    endpoint = tool_endpoints.get(name) if isinstance(name, str) else None
    if endpoint is None:
        raise ToolOutcomeError(
            "the loop names no tool endpoint this deployment lists, so no tool answered live"
        )
    return set(endpoint.tools)


def _tool_versions(session: Session, run: Run) -> set[tuple[str, str]]:
    """(tool name, schema hash) of every tool the run's tasks list: its dataset's, else
    (a probe of chosen tasks) the loop's."""
    tools = tool_schemas(session=session, loop_id=run.loop_id, dataset_id=run.dataset_id)
    return {
        (tool["name"], schema_hash(tool))
        for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("name"), str)
    }


# -- unanswerable calls ----------------------------------------------------------------


def _set_aside_unanswerable(session: Session, run: Run, metrics: Mapping[str, Any]) -> list[int]:
    hopeless = _hopeless_tasks(metrics.get(UNANSWERABLE_KEY))
    if not hopeless:
        return []
    rows = row_ids_by_job_task_id(
        session=session, loop_id=run.loop_id, job_task_ids=hopeless, dataset_id=run.dataset_id
    )
    now = dt.datetime.now(dt.UTC)
    changed: list[int] = []
    for job_task_id, row_id in sorted(rows.items()):
        episodes, calls = hopeless[job_task_id]
        detail = (
            f"every one of its {episodes} episode(s) in run {run.id} needed a tool result "
            f"nobody could give ({calls} call(s): no recorded result, no live endpoint or a "
            "tool off its allow-list, or the endpoint failed)"
        )
        changed += set_aside_tasks(
            session=session,
            loop_id=run.loop_id,
            task_ids=[row_id],
            reason=UNANSWERABLE_CALLS,
            detail=detail,
            at=now,
        )
    return changed


def _hopeless_tasks(report: Any) -> dict[str, tuple[int, int]]:
    """``{job task id: (episodes, calls)}`` of the tasks whose every episode hit an
    unanswerable call, from a job's ``unanswerable_calls``; :class:`ToolOutcomeError` names a
    malformed entry."""
    if report is None:
        return {}
    if not isinstance(report, Mapping) or len(report) > MAX_REPORTED_TASKS:
        raise ToolOutcomeError(f"metrics.{UNANSWERABLE_KEY} must be an object of task id -> counts")
    hopeless: dict[str, tuple[int, int]] = {}
    for task_id, counts in report.items():
        where = f"metrics.{UNANSWERABLE_KEY}[{str(task_id)[:16]!r}]"
        if not isinstance(task_id, str) or not 1 <= len(task_id) <= 64:
            raise ToolOutcomeError(f"{where}: the key must be a task id")
        if not isinstance(counts, Mapping):
            raise ToolOutcomeError(f"{where} must be an object of counts")
        calls, episodes = _count(counts, "calls", where), _count(counts, "episodes", where)
        unanswered = _count(counts, "episodes_unanswered", where)
        if unanswered > episodes or (unanswered and not calls):
            raise ToolOutcomeError(f"{where}: counts that cannot all hold")
        if episodes >= MIN_EPISODES_TO_SET_ASIDE and unanswered == episodes:
            hopeless[task_id] = (episodes, calls)
    return hopeless


def _count(mapping: Mapping[str, Any], key: str, where: str = f"metrics.{ANSWERS_KEY}") -> int:
    value = mapping.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ToolOutcomeError(f"{where}.{key} must be a non-negative integer")
    return value


def _note(run: Run, message: str) -> None:
    run.error = f"{run.error}; {message}" if run.error else message
    logger.warning("run %s: %s", run.id, message)
