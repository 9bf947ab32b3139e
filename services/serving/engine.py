"""What the model server asks of a model family, and the batched decode loop they share.

A *model family engine* (:class:`Engine`) turns chat messages into token ids with the
family's template, runs a batch of prompts forward with a key/value cache, and turns the
generated text back into an assistant message (content or tool calls). The server never
sees tensors: it hands :class:`GenerationRequest` rows to the scheduler, which keeps one
:class:`ActiveBatch` per engine running.

:class:`ActiveBatch` is one decode loop for every family: rows are prefilled (left-padded)
when they join, then each forward step makes one new token for every row, each row sampled
with its own temperature, top-p and seed and stopping on its own stop ids, stop strings or
token budget. Rows join between steps and leave as soon as they finish (continuous
batching, as vLLM schedules): a request that arrives while a batch decodes starts at the
next step instead of waiting for the whole batch, and a finished row costs nothing more.
Engines whose cache cannot be joined or cut (``BatchForward.admit`` / ``retain`` unset) fall
back to whole batches. Sampling is Gumbel-max on nucleus-masked logits with counter-based
noise keyed by the row's seed and the row's own token count
(:mod:`services.training.rng`), so a seeded request gets the same tokens whatever else
shares its batch and whenever it joined.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from services.chat.protocol import ChatMessage
from services.training.rng import gumbel

TokenCallback = Callable[[int], None]


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


@dataclass
class GenerationRequest:
    """One row to decode: prompt ids, sampling, and where to report tokens as they come.

    ``cancelled`` is set (from any thread) when nobody waits for the row any more (its client
    hung up): the row leaves its batch at the next step instead of decoding to its budget.
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # a resident adapter of the engine's base model, or the base
    on_token: TokenCallback | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop", "length", or "cancelled" (nobody reads that one)
    prompt_tokens: int


@dataclass
class BatchForward:
    """One running batch's model calls: prefill (B, P) left-padded ids, then one token per row.

    ``admit`` prefills more rows (their ids, valid mask and adapters) and appends them to the
    running batch's cache, returning their next-token logits; ``retain`` keeps only the given
    rows (in that order). Both must also drop cache columns no kept row uses, so a batch that
    runs for hours holds no more than its longest live row. ``new`` is how many more tokens
    the batch may decode (a hint for engines that preallocate their cache).
    """

    prefill: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # ids, valid, new -> (B, V)
    step: Callable[[torch.Tensor], torch.Tensor]  # (B,) -> (B, V)
    # ids (B2, P2), valid (B2, P2), adapters, new -> (B2, V)
    admit: (
        Callable[[torch.Tensor, torch.Tensor, Sequence[str | None], int], torch.Tensor] | None
    ) = None
    retain: Callable[[torch.Tensor], None] | None = None  # row indices (K,) to keep
    cache_width: Callable[[], int] = lambda: 0  # positions the cache holds per row now


class Engine(Protocol):
    """A loaded model of one family, ready to decode batches."""

    family: str
    version: str  # the checkpoint id: what answers is named by its content
    path: str
    device: torch.device
    eos_ids: frozenset[int]
    # The most characters one token stands for: a conversation whose text is longer than
    # context * this cannot fit, and is refused before its template is rendered.
    max_chars_per_token: int

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids for a conversation, ending where the assistant's turn begins."""
        ...

    def decode_text(self, ids: Sequence[int]) -> str: ...

    def parse_reply(self, text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
        """The assistant message in generated ``text``: tool calls, else content."""
        ...

    def forward(self, adapters: Sequence[str | None]) -> BatchForward:
        """Model calls for a batch whose rows use ``adapters`` (None: the base model)."""
        ...

    def adapters(self) -> frozenset[str]:
        """Resident adapter names on this engine's base model."""
        ...

    def context_length(self) -> int: ...


def sample_next(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    counter: int | torch.Tensor,
) -> torch.Tensor:
    """Next token ids (B,) for logits (B, V): greedy where temperature is 0, else Gumbel-max
    over the nucleus (the smallest set of tokens whose probability reaches top_p).

    ``counter`` is the draw number: one for the whole batch, or one per row (B,)."""
    logits = logits.double()  # (B, V)
    greedy = logits.argmax(dim=-1)  # (B,)
    if bool((temperatures <= 0).all()):
        return greedy
    scaled = logits / temperatures.clamp(min=1e-6)[:, None]  # (B, V)
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V) each
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V) mass of strictly better tokens
    keep_sorted = before < top_ps[:, None]  # (B, V); the best token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # (B, V)
    masked = scaled.masked_fill(~keep, -math.inf)  # (B, V)
    noise = gumbel(seeds, counter, logits.shape[-1])  # (B, V)
    sampled = (masked + noise).argmax(dim=-1)  # (B,)
    return torch.where(temperatures <= 0, greedy, sampled)


Tag = TypeVar("Tag")


@dataclass
class _Row(Generic[Tag]):
    request: GenerationRequest
    tag: Tag
    budget: int
    generated: list[int]
    finish: str | None = None


class ActiveBatch(Generic[Tag]):
    """Rows of one engine decoding together; rows join between steps and leave when done.

    Each row carries a ``tag`` (the scheduler's handle for its request) that comes back with
    its result. Not thread-safe: one decode thread owns it.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._forward: BatchForward | None = None
        self._rows: list[_Row[Tag]] = []  # in the forward's batch order
        self._logits: torch.Tensor | None = None  # (B, V) each row's next-token logits

    def __len__(self) -> int:
        return sum(1 for row in self._rows if row.finish is None)

    def can_join(self) -> bool:
        """Whether rows may join now: the batch is empty, or its engine can grow a batch."""
        return self._forward is None or self._forward.admit is not None

    def budget(self, request: GenerationRequest) -> int:
        """The tokens ``request`` may still make; EngineError if its prompt fills the context."""
        limit = self.engine.context_length()
        if len(request.prompt_ids) >= limit:
            raise EngineError(
                f"the prompt is {len(request.prompt_ids)} tokens; this model's context is "
                f"{limit} tokens"
            )
        return min(request.sampling.max_tokens, limit - len(request.prompt_ids))

    @torch.no_grad()
    def join(self, requests: Sequence[tuple[GenerationRequest, Tag]]) -> None:
        """Prefill ``requests`` and add them to the batch (each passed :meth:`budget`)."""
        if not requests:
            return
        if not self.can_join():
            raise RuntimeError("this engine's batch cannot grow while it decodes")
        rows = [_Row(request, tag, self.budget(request), []) for request, tag in requests]
        device = self.engine.device
        longest = max(len(row.request.prompt_ids) for row in rows)
        ids = torch.zeros(
            len(rows), longest, dtype=torch.long, device=device
        )  # (B2, P) left-padded
        valid = torch.zeros(len(rows), longest, dtype=torch.bool, device=device)  # (B2, P)
        for b, row in enumerate(rows):
            prompt = row.request.prompt_ids
            ids[b, longest - len(prompt) :] = torch.tensor(prompt, device=device)
            valid[b, longest - len(prompt) :] = True
        remaining = [row.budget - len(row.generated) for row in (*self._rows, *rows)]
        adapters = [row.request.adapter for row in rows]
        if self._forward is None:
            self._forward = self.engine.forward(adapters)
            logits = self._forward.prefill(ids, valid, max(remaining))
        else:
            assert self._forward.admit is not None
            logits = self._forward.admit(ids, valid, adapters, max(remaining))
        logits = logits.float().cpu()  # (B2, V)
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._rows.extend(rows)

    @torch.no_grad()
    def step(self) -> list[tuple[Tag, GenerationResult]]:
        """Sample one token for every row; the rows that finished, with their results."""
        if self._forward is None or self._logits is None:
            return []
        rows = self._rows
        tokens = sample_next(
            self._logits,
            torch.tensor([r.request.sampling.temperature for r in rows], dtype=torch.float64),
            torch.tensor([r.request.sampling.top_p for r in rows], dtype=torch.float64),
            torch.tensor([r.request.sampling.seed & 0xFFFFFFFF for r in rows], dtype=torch.int64),
            torch.tensor([len(r.generated) for r in rows]),  # each row's draw number
        )  # (B,)
        done: list[tuple[Tag, GenerationResult]] = []
        for row, token in zip(rows, tokens.tolist(), strict=True):
            if row.finish is None and self._advance(row, token):
                done.append((row.tag, self._result(row)))
        if all(row.finish is not None for row in rows):
            self._forward, self._rows, self._logits = None, [], None
            return done
        if done and self._forward.retain is not None:
            keep = [b for b, row in enumerate(rows) if row.finish is None]
            index = torch.tensor(keep, dtype=torch.long)
            self._forward.retain(index.to(self.engine.device))
            self._rows = [rows[b] for b in keep]
            tokens = tokens[index]
        # Without ``retain``, finished rows keep being fed until the batch ends (ignored).
        self._logits = self._forward.step(tokens.to(self.engine.device)).float().cpu()
        return done

    def _advance(self, row: _Row[Tag], token: int) -> bool:
        """Append ``token`` to ``row``; whether the row is now finished."""
        if row.request.cancelled.is_set():
            row.finish = "cancelled"
            return True
        if token in self.engine.eos_ids:
            row.finish = "stop"
            return True
        row.generated.append(token)
        if row.request.on_token is not None:
            row.request.on_token(token)
        if _hit_stop_string(self.engine, row.generated, row.request.sampling.stop):
            row.finish = "stop"
        elif len(row.generated) >= row.budget:
            row.finish = "length"
        return row.finish is not None

    @staticmethod
    def _result(row: _Row[Tag]) -> GenerationResult:
        return GenerationResult(row.generated, row.finish or "length", len(row.request.prompt_ids))

    def cache_width(self) -> int:
        """Positions the running batch's cache holds per row (0 when idle)."""
        return 0 if self._forward is None else self._forward.cache_width()

    def rows(self) -> list[Tag]:
        """The tags of the rows still decoding."""
        return [row.tag for row in self._rows if row.finish is None]


def _hit_stop_string(engine: Engine, ids: list[int], stops: tuple[str, ...]) -> bool:
    if not stops:
        return False
    tail = engine.decode_text(ids[-64:])
    return any(stop in tail for stop in stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI never returns the stop sequence)."""
    cut = len(text)
    for stop in stops:
        index = text.find(stop)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]
