"""What a request to the engine is and what comes back: the sampling of one row, the
request (prompt ids, sampling, session, cancellation), the finished row's result, the
token a streaming client sees, and the engine's refusal.

Plain dataclasses over the standard library (and a :class:`Session` handle): the model
server, the rollouts and the evaluator build and read them; :mod:`services.inference.engine`
decodes them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.inference.prefix_cache import Session


@dataclass(frozen=True)
class SampledToken:
    """One sampled token as a streaming client sees it: its id, its log-probability under
    the model (temperature 1) and, when asked for, the most likely ids with theirs."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


TokenCallback = Callable[[SampledToken], None]


class EngineError(ValueError):
    """A request the engine cannot answer as asked (too long a context, a bad template)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one row is sampled; ``temperature == 0`` is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # how many of the most likely ids to report with each sampled id


@dataclass
class GenerationRequest:
    """One row to decode: prompt ids, sampling, and where to report tokens as they come.

    ``cancelled`` is set (from any thread) when nobody waits for the row any more (its client
    hung up): the row leaves its batch at the next step instead of decoding to its budget.
    ``session`` keeps the row's conversation cached for the episode's next turn.
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # a resident adapter of the engine's base model, or the base
    on_token: TokenCallback | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: Session | None = None


class FinishReason(enum.StrEnum):
    """Why a row stopped: its stop token or a stop string, its token budget, or its
    request's cancellation. The model server answers the first two as OpenAI's
    ``finish_reason``; a cancelled row keeps no session (nobody reads its result)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationResult:
    """A finished row. ``token_ids`` is the text's tokens; ``sampled_ids`` every token
    sampled (the stop token too, when one ended the row), ``logprobs`` one per sampled id."""

    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    sampled_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per sampled id, the ``sampling.top_logprobs`` most likely ids with their log-probs
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI never returns the stop sequence)."""
    cut = len(text)
    for stop in stops:
        index = text.find(stop)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]
