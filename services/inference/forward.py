"""What a model family's forward gets from the engine: the engine's key/value buffers and
which of their rows and columns one model call writes and reads.

A family engine (:class:`~services.inference.engine.Engine`) returns a :class:`BatchForward`;
the engine calls it with a :class:`ForwardCall` per prefill or decode step. The family's
attention writes its new keys and values with :func:`write_columns` and reads the columns
before them, so the buffers are the cache and nothing is concatenated per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """The shape of a family's keys and values per token: layers, kv heads, head size."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class ForwardCall:
    """One model call over the engine's buffers.

    ``ids`` and ``positions`` are (B, T); the new tokens' keys/values go to column
    ``positions[b, t]`` of buffer row ``rows.start + b``; attention reads columns
    ``[0, width)`` of those rows where ``mask`` (B, 1, T, width) allows. ``keys`` and
    ``values`` are (L, R, H, S, D). The call returns the last position's logits (B, V).

    ``shared``: columns ``[0, shared)`` hold the same keys and values in every row of the
    call, bit for bit (one prefix, computed once and copied from the prefix cache), so a
    family's attention may read them from the call's first row for all rows
    (:mod:`services.inference.cascade`). 0: no such promise.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    rows: slice
    width: int
    mask: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    adapters: list[str | None]
    shared: int = 0


@dataclass
class BatchForward:
    """A running batch's model calls: ``prefill`` for a joining row's prompt, ``step`` for
    one new token of every row (two names for one kind of call, so each can be watched)."""

    prefill: Callable[[ForwardCall], torch.Tensor]
    step: Callable[[ForwardCall], torch.Tensor]


def write_columns(
    call: ForwardCall, layer: int, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new keys/values (B, H, T, D) into their positions' columns of the
    call's buffer rows, in place; that layer's columns ``[0, width)`` of those rows
    (B, H, W, D), views of the buffers (nothing is concatenated or copied)."""
    key_rows = call.keys[layer, call.rows]  # (B, H, S, D) view
    value_rows = call.values[layer, call.rows]  # (B, H, S, D) view
    batch, _, tokens, _ = keys.shape
    row = torch.arange(batch, device=keys.device)[:, None].expand(batch, tokens)  # (B, T)
    key_rows[row, :, call.positions] = keys.transpose(1, 2).to(key_rows.dtype)  # (B, T, H, D)
    value_rows[row, :, call.positions] = values.transpose(1, 2).to(value_rows.dtype)
    return key_rows[:, :, : call.width], value_rows[:, :, : call.width]
