"""What the model server asks of a model family, and the batched decode loop they share.

A *model family engine* (:class:`Engine`) turns chat messages into token ids with the
family's template, runs a batch of prompts forward with a key/value cache, and turns the
generated text back into an assistant message (content or tool calls). The server never
sees tensors: it hands :class:`GenerationRequest` rows to the scheduler, which groups the
rows that one engine can decode together and calls :func:`decode_batch` once per group.

:func:`decode_batch` is one loop for every family: prefill all rows (left-padded), then one
forward step per new token for the whole batch, each row sampled with its own temperature,
top-p and seed, stopping on its own stop ids, stop strings or token budget. Sampling is
Gumbel-max on nucleus-masked logits with counter-based noise keyed by the row's seed
(:mod:`services.training.rng`), so a seeded request gets the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
    """One row to decode: prompt ids, sampling, and where to report tokens as they come."""

    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None  # a resident adapter of the engine's base model, or the base
    on_token: TokenCallback | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int


@dataclass
class BatchForward:
    """One batch's model calls: prefill (B, P) left-padded ids, then one token per row."""

    prefill: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # ids, valid, new -> (B, V)
    step: Callable[[torch.Tensor], torch.Tensor]  # (B,) -> (B, V)
    max_positions: int | None = None  # prompt + new tokens must fit (None: no limit)


class Engine(Protocol):
    """A loaded model of one family, ready to decode batches."""

    family: str
    version: str  # the checkpoint id: what answers is named by its content
    path: str
    device: torch.device
    eos_ids: frozenset[int]

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
    counter: int,
) -> torch.Tensor:
    """Next token ids (B,) for logits (B, V): greedy where temperature is 0, else Gumbel-max
    over the nucleus (the smallest set of tokens whose probability reaches top_p)."""
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


@torch.no_grad()
def decode_batch(
    engine: Engine, rows: Sequence[GenerationRequest], device: torch.device
) -> list[GenerationResult]:
    """Decode ``rows`` together (one forward per new token for all of them)."""
    if not rows:
        return []
    forward = engine.forward([row.adapter for row in rows])
    limit = forward.max_positions
    budgets = []
    for row in rows:
        budget = row.sampling.max_tokens
        if limit is not None:
            if len(row.prompt_ids) >= limit:
                raise EngineError(
                    f"the prompt is {len(row.prompt_ids)} tokens; this model's context is "
                    f"{limit} tokens"
                )
            budget = min(budget, limit - len(row.prompt_ids))
        budgets.append(budget)
    batch, longest = len(rows), max(len(row.prompt_ids) for row in rows)
    ids = torch.zeros(batch, longest, dtype=torch.long, device=device)  # (B, P) left-padded
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=device)  # (B, P)
    for b, row in enumerate(rows):
        ids[b, longest - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids, device=device)
        valid[b, longest - len(row.prompt_ids) :] = True
    temperatures = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float64)
    top_ps = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float64)
    seeds = torch.tensor([r.sampling.seed & 0xFFFFFFFF for r in rows], dtype=torch.int64)
    generated: list[list[int]] = [[] for _ in rows]
    finish: list[str | None] = [None] * batch
    logits = forward.prefill(ids, valid, max(budgets)).float().cpu()  # (B, V)
    for t in range(max(budgets)):
        tokens = sample_next(logits, temperatures, top_ps, seeds, t)  # (B,)
        for b, token in enumerate(tokens.tolist()):
            if finish[b] is not None:
                continue
            if token in engine.eos_ids:
                finish[b] = "stop"
                continue
            generated[b].append(token)
            callback = rows[b].on_token
            if callback is not None:
                callback(token)
            if _hit_stop_string(engine, generated[b], rows[b].sampling.stop):
                finish[b] = "stop"
            elif len(generated[b]) >= budgets[b]:
                finish[b] = "length"
        if all(reason is not None for reason in finish):
            break
        logits = forward.step(tokens.to(device)).float().cpu()  # (B, V)
    return [
        GenerationResult(generated[b], finish[b] or "length", len(rows[b].prompt_ids))
        for b in range(batch)
    ]


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
