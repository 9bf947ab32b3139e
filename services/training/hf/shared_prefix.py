"""Training passes that compute a prefix shared by several rows once.

Every chat sequence a trainer scores starts with the same system text and tool list (~330 of
SmolLM2's ~385 tokens in a toolcalc demonstration, docs/models.md), and a GRPO group's rows
with the same whole prompt; the targets (the assistant's turns) all come after it. A plain
forward and backward pass over N such rows computes that prefix N times. Here rows that
share a prefix are scored in two calls: the prefix once, as one row, keeping its keys and
values (with their autograd history), then every row's own tokens after it against those
keys and values, broadcast to the rows. The backward pass of the broadcast sums the rows'
gradients into the one prefix computation, which is exactly the sum the plain pass computes
N times over, so the log-probs and the gradients are the plain pass's to rounding (tested).

Only positions no row trains on go into the shared part (the prefix stops at the first
target position of any of its rows), so the output head is applied where it was before.
LoRA dropout would draw one mask for the shared prefix where the plain pass draws one per
row; with dropout on in training mode the rows are scored the plain way.
"""

from __future__ import annotations

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
    sorted by their tokens, so rows with a common prefix are neighbours, and grouped
    greedily; a row that shares too little with its neighbours is a group of its own
    (``shared`` 0)."""
    rows = [ids[r, : lengths[r]].tolist() for r in range(ids.shape[0])]
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    groups: list[PrefixGroup] = []
    members: list[int] = []
    shared = 0
    for r in order:
        if members:
            common = min(shared, _common_length(rows[members[0]], rows[r]), limits[r])
            if common >= min_shared:
                members.append(r)
                shared = common
                continue
            groups.append(PrefixGroup(members, shared if len(members) > 1 else 0))
        members, shared = [r], limits[r]
    if members:
        groups.append(PrefixGroup(members, shared if len(members) > 1 else 0))
    return groups


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
        _score_rows(model, ids, attention, target, alone, out)
    for group in groups:
        if group.shared:
            _score_group(model, ids, attention, target, group, out)
    return out


def _shareable(target_row: torch.Tensor, length: int) -> int:
    """How many leading tokens of a row may be shared: none past its first target position
    (the output head is applied there) and at least one token of its own after them."""
    marked = target_row.nonzero()
    first = int(marked[0, 0]) if marked.numel() else length - 1
    return max(0, min(first, length - 1))


def _score_rows(
    model: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    target: torch.Tensor,
    rows: list[int],
    out: torch.Tensor,
) -> None:
    """The plain pass over ``rows``, written into ``out``."""
    index = torch.tensor(rows, device=ids.device)
    width = int(attention[index].sum(dim=1).max())
    sub_ids, sub_target = ids[index, :width], target[index, : width - 1]  # (G, W), (G, W-1)
    keep = sub_target.any(dim=0).nonzero().squeeze(-1)  # (K,)
    if keep.numel() == 0:
        return
    logits = model(
        input_ids=sub_ids, attention_mask=attention[index, :width], logits_to_keep=keep
    ).logits  # (G, K, V)
    picked = _picked(logits, sub_ids[:, keep + 1])  # (G, K)
    out[index[:, None], keep[None, :]] = picked


def _score_group(
    model: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    target: torch.Tensor,
    group: PrefixGroup,
    out: torch.Tensor,
) -> None:
    """The group's shared prefix as one row, then every row's own tokens after it."""
    index = torch.tensor(group.rows, device=ids.device)
    shared = group.shared
    width = int(attention[index].sum(dim=1).max())
    keyword = cache_keyword(model)
    # Only its keys and values are used: the output head runs on one position, not all.
    prefix = model(input_ids=ids[index[:1], :shared], use_cache=True, logits_to_keep=1)
    cache = _broadcast_cache(getattr(prefix, keyword), len(group.rows))
    own_target = target[index, shared : width - 1]  # (G, W-1-S)
    keep = own_target.any(dim=0).nonzero().squeeze(-1)  # (K,) relative to the prefix's end
    if keep.numel() == 0:
        return
    positions = torch.arange(shared, width, device=ids.device).expand(len(group.rows), -1)
    logits = model(
        input_ids=ids[index, shared:width],
        attention_mask=attention[index, :width],
        position_ids=positions,
        use_cache=True,
        **{keyword: cache},
        logits_to_keep=keep,
    ).logits  # (G, K, V)
    picked = _picked(logits, ids[index][:, shared + keep + 1])  # (G, K)
    out[index[:, None], (shared + keep)[None, :]] = picked


def _picked(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # (G, K, V)
    return logp.gather(-1, next_ids[..., None]).squeeze(-1)  # (G, K)


def _broadcast_cache(cache: Any, rows: int) -> Any:
    """The one-row prefix cache as ``rows`` rows: views, so its gradient is the rows' sum."""
    for layer in cache.layers:
        layer.keys = layer.keys.expand(rows, -1, -1, -1)
        layer.values = layer.values.expand(rows, -1, -1, -1)
    return cache


def _dropout_active(model: Any) -> bool:
    """Whether a dropout module would draw masks in this pass (training mode, p > 0)."""
    if not model.training:
        return False
    if float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules())
