"""What a job's sandbox learned: the live answers it got, and the calls nobody could answer.

Two things leave a job through its output dir and ``metrics.json`` (the worker records them
after the job, :mod:`services.curation.tool_outcomes`):

- **live answers** (``tool_answers.jsonl``, one ``ratchet.tool_response/v1`` line per call,
  the store file's format, :mod:`.records`): every result a live endpoint gave this
  process and that was not an error, under the key of the call the agent actually made
  (tool name, the task's schema hash of that tool, canonical arguments). The worker adds
  them to the loop's tool-response store, so the next snapshot's rollouts replay them
  instead of calling again; within the job, a second identical call is answered from here.
  Listed in ``metrics.json`` as ``tool_answers`` = ``{"file", "bytes", "sha256", "count"}``.
- **unanswerable calls** (``metrics.json``'s ``unanswerable_calls``): per task (its job
  task id) that needed a result nobody could give (no record, no endpoint or not on its
  allow-list, the endpoint failed), ``{"calls": c, "episodes": n, "episodes_unanswered":
  k}``: ``c`` such calls in ``k`` of the task's ``n`` verified episodes. A task whose every
  episode hit one (``k == n``) taught nothing but noise; the worker sets it aside.

It also holds the sandbox's two small rules on a call's arguments (:func:`usage_error`, the
error the real tool gives a call its schema refuses; :func:`arguments_object`, what a live
tool is sent).

An episode counts once it is verified (every rolled-out episode is, exactly once, whichever
way it ended); a call marks the episode object it belongs to, held by a weak reference so an
episode that is never verified leaves no trace.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.environments.replay.records import RecordedCall

TOOL_ANSWERS_FILE = "tool_answers.jsonl"
ANSWERS_KEY = "tool_answers"
UNANSWERABLE_KEY = "unanswerable_calls"
USAGE_KEY = "tool_endpoints"
MAX_ANSWERS = 50_000  # a job's answers file stays far below the worker's read bound

_Key = tuple[str, str, str]


@dataclass
class _Tally:
    episodes: int = 0
    unanswered: int = 0  # episodes with at least one unanswerable call
    calls: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "episodes": self.episodes,
            "episodes_unanswered": self.unanswered,
        }


class SandboxLedger:
    """The live answers and unanswerable calls of one process (thread-safe)."""

    def __init__(self) -> None:
        # Re-entrant: a weak reference's callback may run (an episode collected) while
        # this thread holds the lock.
        self._lock = threading.RLock()
        self._live: dict[_Key, str] = {}
        self._tallies: dict[str, _Tally] = {}
        self._marks: dict[int, tuple[weakref.ref[Any], int]] = {}

    # -- live answers -------------------------------------------------------------------

    def live(self, key: _Key) -> str | None:
        """The answer an endpoint already gave this process for ``key``, if any."""
        with self._lock:
            return self._live.get(key)

    def remember(self, call: RecordedCall) -> None:
        """Keep a live answer (the first for its key; at most :data:`MAX_ANSWERS`)."""
        with self._lock:
            if call.key not in self._live and len(self._live) < MAX_ANSWERS:
                self._live[call.key] = call.result

    def answers(self) -> list[RecordedCall]:
        with self._lock:
            return [RecordedCall(*key, result) for key, result in sorted(self._live.items())]

    # -- unanswerable calls -------------------------------------------------------------

    def unanswered(self, episode: object) -> None:
        """One call of ``episode`` got no result."""
        key = id(episode)
        with self._lock:
            ref, count = self._marks.get(key, (None, 0))
            if ref is None or ref() is not episode:
                ref, count = weakref.ref(episode, self._forget(key)), 0
            self._marks[key] = (ref, count + 1)

    def episode_verified(self, task_id: str, episode: object) -> None:
        """``episode`` of task ``task_id`` is done: count it, and its unanswerable calls."""
        with self._lock:
            ref, count = self._marks.pop(id(episode), (None, 0))
            calls = count if ref is not None and ref() is episode else 0
            tally = self._tallies.setdefault(task_id, _Tally())
            tally.episodes += 1
            tally.calls += calls
            tally.unanswered += 1 if calls else 0

    def unanswerable(self) -> dict[str, dict[str, int]]:
        """``unanswerable_calls`` for metrics.json: the tasks with any, see the module."""
        with self._lock:
            return {
                task_id: tally.to_dict()
                for task_id, tally in sorted(self._tallies.items())
                if tally.calls
            }

    def _forget(self, key: int) -> Any:
        def drop(ref: weakref.ref[Any]) -> None:
            with self._lock:
                if self._marks.get(key, (None, 0))[0] is ref:
                    del self._marks[key]

        return drop

    # -- the job's outputs --------------------------------------------------------------

    def job_outputs(self, output_dir: Path, usage: dict[str, dict[str, int]]) -> dict[str, Any]:
        """Write the answers file (when there are answers); the metrics.json keys."""
        out: dict[str, Any] = {UNANSWERABLE_KEY: self.unanswerable()}
        if usage:
            out[USAGE_KEY] = usage
        answers = self.answers()
        if answers:
            out[ANSWERS_KEY] = write_tool_answers(output_dir, answers)
        return out


def write_tool_answers(output_dir: Path, calls: list[RecordedCall]) -> dict[str, Any]:
    """Write ``tool_answers.jsonl`` atomically; its listing for ``metrics.json``."""
    data = "".join(
        json.dumps(call.to_dict(), sort_keys=True, ensure_ascii=False) + "\n" for call in calls
    ).encode("utf-8")
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / TOOL_ANSWERS_FILE
    tmp = path.with_name(f".{TOOL_ANSWERS_FILE}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return {
        "file": TOOL_ANSWERS_FILE,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "count": len(calls),
    }


def usage_error(tool: Mapping[str, Any], arguments: Mapping[str, Any] | str) -> str | None:
    """The error the real tool gives a call its schema refuses, or None."""
    name = tool.get("name")
    parameters = tool.get("parameters") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return f"error: arguments of {name} are not valid JSON"
        if not isinstance(arguments, dict):
            return f"error: arguments of {name} must be a JSON object"
    required = parameters.get("required") or []
    missing = sorted(str(r) for r in required if r not in arguments)
    if missing:
        return f"error: {name} is missing required argument(s) {', '.join(missing)}"
    properties = parameters.get("properties")
    if parameters.get("additionalProperties") is False and isinstance(properties, Mapping):
        unknown = sorted(str(k) for k in arguments if k not in properties)
        if unknown:
            return f"error: {name} takes no argument(s) {', '.join(unknown)}"
    return None


def arguments_object(arguments: Mapping[str, Any] | str) -> dict[str, Any]:
    """A call's arguments as the object a live tool takes (the usage check already refused
    text that is not a JSON object)."""
    if isinstance(arguments, str):
        decoded = json.loads(arguments) if arguments.strip() else {}
        return dict(decoded) if isinstance(decoded, dict) else {}
    return dict(arguments)
