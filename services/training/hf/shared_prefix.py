"""Training passes that compute a prefix shared by several rows once.

Every chat sequence a trainer scores starts with the same system text and tool list (~330 of
SmolLM2's ~385 tokens in a toolcalc demonstration, docs/models.md), and a GRPO group's rows
with the same whole prompt; the targets (the assistant's turns) all come after it. A plain
forward and backward pass over N such rows computes that prefix N times. Here rows that
share a prefix are scored apart: the prefix once, as one row, keeping its keys and values
(with their autograd history), then each row's own tokens after it against those keys and
values. The backward pass sums the rows' gradients into the one prefix computation, which is
exactly the sum the plain pass computes N times over, so the log-probs and the gradients are
the plain pass's to rounding (tested).

Only positions no row trains on go into the shared part (the prefix stops at the first
target position of any of its rows), so the output head is applied where it was before.
LoRA dropout would draw one mask for the shared prefix where the plain pass draws one per
row; with dropout on in training mode the rows are scored the plain way.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.training.hf.kv_cache import cache_keyword

# Below this many shared tokens a second model call costs more than the prefix it saves.
MIN_SHARED_TOKENS = 32


@dataclass(frozen=True)
class PrefixGroup:
    """Rows (indices into the batch) whose first ``shared`` tokens are the same."""

    rows: list[int]
    shared: int


def prefix_groups(
    ids: torch.Tensor, lengths: Sequence[int], limits: Sequence[int], *, min_shared: int
) -> list[PrefixGroup]:
    """Rows of ``ids`` (N, T) grouped by a common prefix of at least ``min_shared`` tokens.

    Row ``r`` has ``lengths[r]`` real tokens and may share at most ``limits[r]`` of them (its
    first target position, and at least one token of its own after the prefix). Rows are
    sorted by their tokens, so rows with a common prefix are neighbours, and cut into runs
    that save the most tokens (:func:`_best_runs`); a row that shares too little with its
    neighbours is a group of its own (``shared`` 0)."""
    rows = [ids[r, : lengths[r]].tolist() for r in range(ids.shape[0])]
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    # in sorted order a run's common prefix is the least of its neighbours' common prefixes
    adjacent = [_common_length(rows[a], rows[b]) for a, b in itertools.pairwise(order)]
    runs = _best_runs([limits[r] for r in order], adjacent, min_shared=min_shared)
    return [PrefixGroup(order[begin:end], shared) for begin, end, shared in runs]


def _best_runs(
    limits: Sequence[int], adjacent: Sequence[int], *, min_shared: int
) -> list[tuple[int, int, int]]:
    """Sorted rows cut into runs ``(begin, end, shared)`` that skip the most prefix tokens.

    A run of k rows sharing S tokens skips (k - 1) * S of them at the price of one more
    model call, counted as ``min_shared`` tokens. Cutting greedily (a row joins while the
    run still shares ``min_shared``) is not enough: rows whose tool lists differ in the
    middle (a tool that changed) share only the system text as one run of four, and twice
    as much as two runs of two. Rows are a micro-batch (a handful), so the exact answer, a
    dynamic programme over cut points, costs nothing."""
    n = len(limits)
    best = [0] * (n + 1)  # best[i]: tokens skipped by the best cut of rows [0, i)
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # best[i]'s last run: (begin, shared)
    for end in range(1, n + 1):
        best[end], cut[end] = best[end - 1], (end - 1, 0)  # row end-1 alone
        shared = limits[end - 1]
        for begin in range(end - 2, -1, -1):
            shared = min(shared, adjacent[begin], limits[begin])
            if shared < min_shared:
                break
            saved = best[begin] + (end - begin - 1) * shared - min_shared
            if saved > best[end]:
                best[end], cut[end] = saved, (begin, shared)
    runs: list[tuple[int, int, int]] = []
    end = n
    while end > 0:
        begin, shared = cut[end]
        runs.append((begin, end, shared))
        end = begin
    return runs[::-1]


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix_logprobs(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, target: torch.Tensor
) -> torch.Tensor | None:
    """``sequence_logprobs`` of the rows of ``ids`` (N, T) at the positions ``target``
    (N, T-1) marks, computing each shared prefix once: (N, T-1), 0 elsewhere. None when no
    two rows share enough to be worth it (the caller then runs its plain pass)."""
    if _dropout_active(model):
        return None
    lengths = attention.sum(dim=1).tolist()
    limits = [_shareable(target[r], lengths[r]) for r in range(ids.shape[0])]
    groups = prefix_groups(ids, lengths, limits, min_shared=MIN_SHARED_TOKENS)
    if all(group.shared == 0 for group in groups):
        return None
    out = torch.zeros(target.shape, dtype=torch.float32, device=ids.device)  # (N, T-1)
    alone = [r for group in groups if group.shared == 0 for r in group.rows]
    if alone:
        _score_after_prefix(model, ids, lengths, target, PrefixGroup(alone, 0), out)
    for group in groups:
        if group.shared:
            _score_after_prefix(model, ids, lengths, target, group, out)
    return out


def _shareable(target_row: torch.Tensor, length: int) -> int:
    """How many leading tokens of a row may be shared: none past its first target position
    (the output head is applied there) and at least one token of its own after them."""
    marked = target_row.nonzero()
    first = int(marked[0, 0]) if marked.numel() else length - 1
    return max(0, min(first, length - 1))


def _score_after_prefix(
    model: Any,
    ids: torch.Tensor,
    lengths: Sequence[int],
    target: torch.Tensor,
    group: PrefixGroup,
    out: torch.Tensor,
) -> None:
    """The group's shared prefix once, as one row, then each row's own tokens after it, a
    row at a time against the prefix's keys and values, written into ``out``.

    A row at a time, not the rows padded to the longest: their own parts differ in length
    (a demonstration's answers and tool results), padding computed ~60% more tokens than
    the rows hold, and attention (CPU's flash kernel computes every masked block) grows with
    the padded width. Measured on the bookshop bootstrap's demonstrations (4 SFT steps of 8,
    micro-batches of 4, 2 threads): padded 92.0 s, one packed row with a block-diagonal mask
    92.5 s, a row at a time 86.2 s (137.7 s before the rows were sorted and cut, above)."""
    shared = group.shared
    prefix = None
    keyword = cache_keyword(model)
    if shared:
        # Only its keys and values are used: the output head runs on one position, not all.
        first = ids[group.rows[:1], :shared]
        prefix = getattr(model(input_ids=first, use_cache=True, logits_to_keep=1), keyword)
    for r in group.rows:
        end = int(lengths[r])
        keep = target[r, shared : end - 1].nonzero().squeeze(-1)  # (K,) after the prefix
        if keep.numel() == 0:
            continue
        inputs: dict[str, Any] = {
            "input_ids": ids[r : r + 1, shared:end],  # (1, L)
            "attention_mask": torch.ones((1, end), dtype=torch.long, device=ids.device),
            "position_ids": torch.arange(shared, end, device=ids.device)[None],
            "logits_to_keep": keep,
            "use_cache": prefix is not None,
        }
        if prefix is not None:
            inputs[keyword] = _reusable(prefix)
        logits = model(**inputs).logits[0]  # (K, V)
        out[r, shared + keep] = _picked(logits, ids[r, shared + keep + 1])


def _reusable(cache: Any) -> Any:
    """The prefix's cache as a new cache object over the same tensors: a call appends its
    row's keys and values to the cache it is given (by concatenation, so the prefix's own
    tensors, and their autograd history, stay as they are for the next row)."""
    fresh = copy.copy(cache)
    fresh.layers = [copy.copy(layer) for layer in cache.layers]
    return fresh


def _picked(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # (K, V)
    return logp.gather(-1, next_ids[..., None]).squeeze(-1)  # (K,)


def _dropout_active(model: Any) -> bool:
    """Whether a dropout module would draw masks in this pass (training mode, p > 0)."""
    if not model.training:
        return False
    if float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules())
