"""Warnings in the ingest answer: a trace stored as asked that curation will not learn from.

The webhook stores whatever matches ``ratchet.trace/v1``; what curation makes of a trace is
decided later, by the loop's environment. A trace with no tools on a ``replay`` loop is
stored, then rejected (``no_tools``) minutes later where nobody who posted it looks. So the
answer's item carries ``warnings`` for what the body alone already tells:

- ``no_tools`` (replay): the trace lists no tools; curation rejects it with that reason.
- ``unlisted_tool`` (replay): an assistant message calls a tool the trace's tools do not
  list. Curation keeps the trace, but a replay task offers only the listed tools: that call
  cannot be replayed (the sandbox answers it ``error: unknown tool NAME``), so the recorded
  episode is not one the model can repeat. Usually the trace's ``tools`` are incomplete.

Only checks of the typed trace that cost microseconds run here (this is the ingest hot
path); anything that depends on other traces, feedback or the loop's policy (a reward
source, a duplicate task) is curation's to say, in ``ratchet traces show``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.environments.replay.env import ENVIRONMENT_NAME as REPLAY

if TYPE_CHECKING:
    from services.ingest.schema import TraceV1


@dataclass(frozen=True, slots=True)
class TraceWarning:
    """One warning of an accepted trace: its code, the field it is about, what it means."""

    code: str
    path: str
    message: str


# What an ingest door runs on each valid trace of a loop (None: nothing to check).
Screen = Callable[["TraceV1"], list[TraceWarning]]


def screen_for(environment: str) -> Screen | None:
    """The checks for a loop of ``environment`` (None when there are none)."""
    return replay_warnings if environment == REPLAY else None


def replay_warnings(trace: TraceV1) -> list[TraceWarning]:
    """What a replay loop's curation will make of ``trace`` that its poster should know."""
    if not trace.tools:
        return [
            TraceWarning(
                "no_tools",
                "tools",
                "curation will reject this trace (no_tools): it lists no tools, and replay "
                "needs the tools the agent was given",
            )
        ]
    listed = {tool.name for tool in trace.tools}
    warnings: list[TraceWarning] = []
    for m, message in enumerate(trace.messages):
        for c, call in enumerate(message.tool_calls or ()):
            if call.name not in listed:
                warnings.append(
                    TraceWarning(
                        "unlisted_tool",
                        f"messages.{m}.tool_calls.{c}.name",
                        f"calls {call.name!r}, which the trace's tools do not list: a replay "
                        "task offers only the listed tools, so this call cannot be replayed "
                        f"(it gets `error: unknown tool {call.name}`); add the tool to the "
                        "trace's tools",
                    )
                )
    return warnings
