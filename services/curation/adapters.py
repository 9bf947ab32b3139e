"""The one thing curation needs from an environment: turn a trace into a task, or say why not.

To make a new kind of agent curatable, implement :class:`TraceAdapter` (a ``name`` and
``task_from_trace``) and register it with ``services.environments.register_environment``;
the loop's ``environment`` column names it. A full :class:`~services.environments.base.
Environment` is also a trace adapter, and its ``start`` tells curation which part of the
prompt is the user's request (see :func:`similarity_text`).

An adapter must not trust the trace's claimed answer or outcome: it rebuilds a task whose
verifier can check any answer, from the request alone, or returns a
:class:`~services.environments.base.Rejection` with a stable ``reason`` code. Exceptions are
caught and recorded as ``adapter_error``, so a bug in an adapter never blocks a batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast, runtime_checkable

from services.environments.base import Environment, Rejection, TaskSpec


@runtime_checkable
class TraceAdapter(Protocol):
    """Builds a verifiable task from a ``ratchet.trace/v1`` trace."""

    name: str

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        """The task behind ``trace`` (verifier + params), or why there is none."""
        ...


AdapterResolver = Callable[[str], TraceAdapter]


def default_resolver(name: str) -> TraceAdapter:
    """The registered environment called ``name``; unknown names raise ValueError."""
    from services.environments import get_environment

    return get_environment(name)


def adapt(adapter: TraceAdapter, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
    """Run the adapter, turning its exceptions and wrong return types into rejections."""
    try:
        result = adapter.task_from_trace(trace)
    except Exception as exc:
        return Rejection("adapter_error", f"{type(exc).__name__}: {exc}"[:500])
    if isinstance(result, TaskSpec | Rejection):
        return result
    return Rejection("adapter_error", f"adapter returned {type(result).__name__}, not a task")


@functools.lru_cache(maxsize=64)
def _is_environment(kind: type) -> bool:
    """Whether instances of ``kind`` are full environments (a Protocol check, cached)."""
    return all(callable(getattr(kind, name, None)) for name in _ENVIRONMENT_METHODS)


_ENVIRONMENT_METHODS = ("start", "step", "verify", "run_episode", "task_from_trace")


def similarity_text(adapter: TraceAdapter, task: TaskSpec) -> str:
    """The text near-duplicate detection compares: the user's request when known.

    Tool listings and system prompts are shared by every task of a loop; compared whole,
    all of a loop's tasks would look alike. An environment's first episode state separates
    the request (``Episode.user``) from the rest, so that is what is compared; adapters
    that are not full environments are compared on the whole prompt.
    """
    if _is_environment(type(adapter)):
        environment = cast(Environment, adapter)
        try:
            user = environment.start(task, max_turns=1).user
        except Exception:
            return task.prompt
        if isinstance(user, str) and user.strip():
            return user
    return task.prompt
