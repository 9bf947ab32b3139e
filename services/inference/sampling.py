"""How the engine picks each row's next token, and the log-probabilities it reports.

Sampling is Gumbel-max on nucleus-masked logits with counter-based noise keyed by the row's
seed and the row's own token count (:mod:`services.training.rng`), so a seeded request gets
the same tokens whatever else shares its batch and whenever it joined.
"""

from __future__ import annotations

import math

import torch

from services.training.rng import gumbel


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
    greedy = logits.argmax(dim=-1)  # (B,)
    if bool((temperatures <= 0).all()):
        return greedy
    # In place on one float64 copy: each (B, V) temporary costs page faults at this size.
    scaled = logits.to(torch.float64, copy=True).div_(temperatures.clamp(min=1e-6)[:, None])
    masked = scaled if bool((top_ps >= 1).all()) else _nucleus(scaled, top_ps)  # (B, V)
    noise = gumbel(seeds, counter, logits.shape[-1])  # (B, V)
    sampled = noise.add_(masked).argmax(dim=-1)  # (B,)
    return torch.where(temperatures <= 0, greedy, sampled)


def _nucleus(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """``scaled`` (B, V) with every token outside each row's nucleus at -inf (a row whose
    top_p is 1 keeps every token: its nucleus is the whole vocabulary)."""
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V) each
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V) mass of strictly better tokens
    keep_sorted = (before < top_ps[:, None]) | (top_ps[:, None] >= 1)  # (B, V); best kept
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # (B, V)
    return scaled.masked_fill(~keep, -math.inf)


def top_logprobs(logprobs: torch.Tensor, counts: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Each row's ``counts[b]`` most likely ids with their log-probs, from (B, V)."""
    most = min(max(counts, default=0), logprobs.shape[-1])
    if most == 0:
        return [() for _ in counts]
    values, ids = logprobs.topk(most, dim=-1)  # (B, k) each
    return [
        tuple(zip(row_ids[:k], row_values[:k], strict=True))
        for row_ids, row_values, k in zip(ids.tolist(), values.tolist(), counts, strict=True)
    ]
