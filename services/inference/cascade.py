"""Decode attention that reads a prefix every row shares once, not once per row.

Every row of a rollout batch starts with the same system text and tool list, and a GRPO
group's rows with the same whole prompt: the engine copies those keys and values into each
row's cache columns from the prefix cache (:class:`~services.inference.forward.ForwardCall`
``shared``). Plain attention then reads one copy per row each decode step, and on a CPU that
memory traffic, not arithmetic, is what a decode step's attention costs. Cascade attention
(as FlashInfer and vLLM do on a GPU) splits it in two: the shared columns against every
row's query in one matrix product over the first row's copy, the row's own columns after
them as usual, and the two softmax parts merged by their log-sum-exp. The result is the same
softmax attention, equal to rounding.

Used for decode steps (one new token per row) of plain softmax attention in fp32, where the
shared part is long enough and the rows many enough to pay for the extra operations; every
other call goes to ``torch.nn.functional.scaled_dot_product_attention`` as before.
"""

from __future__ import annotations

import torch

# Below these the split costs more small operations than the one read it saves (measured on
# SmolLM2-135M's shapes on 2 CPU cores: at 64 rows and 336 shared columns of 420 a layer's
# decode attention took 2.9-3.9 ms against SDPA's 4.9-5.7 ms).
MIN_ROWS = 8
MIN_SHARED_COLUMNS = 64


def worth_cascading(query: torch.Tensor, shared: int) -> bool:
    """Whether a call with ``query`` (B, H, T, D) and ``shared`` columns should cascade."""
    rows, _, tokens, _ = query.shape
    return (
        tokens == 1
        and rows >= MIN_ROWS
        and shared >= MIN_SHARED_COLUMNS
        and query.dtype == torch.float32
    )


def cascade_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shared: int,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of one new token per row, (B, H, 1, D), over ``keys``/``values``
    (B, Hkv, W, D) whose columns ``[0, shared)`` are the same in every row; ``mask`` is
    additive, (B, 1, 1, W), and lets every row see every shared column.

    Grouped-query heads (H a multiple of Hkv) are read as groups of their kv head."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = query.view(rows, kv_heads, group, dim)  # (B, Hkv, g, D)
    # The shared columns, once: every row's queries of a kv head against its first row's copy.
    stacked = grouped.transpose(0, 1).reshape(kv_heads, rows * group, dim)  # (Hkv, B*g, D)
    scores = torch.matmul(stacked, keys[0, :, :shared].transpose(1, 2)).mul_(scale)
    shared_max = scores.amax(dim=-1, keepdim=True)  # (Hkv, B*g, 1)
    weights = scores.sub_(shared_max).exp_()
    shared_sum = weights.sum(dim=-1, keepdim=True)
    shared_out = torch.matmul(weights, values[0, :, :shared])  # (Hkv, B*g, D)
    shared_max, shared_sum, shared_out = (
        t.view(kv_heads, rows, group, -1).transpose(0, 1)  # (B, Hkv, g, ·)
        for t in (shared_max, shared_sum, shared_out)
    )
    # Each row's own columns after them (its last one, the new token, is never masked).
    own = torch.matmul(grouped, keys[:, :, shared:].transpose(-1, -2)).mul_(scale)
    own.add_(mask[:, :, :, shared:])  # (B, Hkv, g, W - shared)
    top = torch.maximum(shared_max, own.amax(dim=-1, keepdim=True))
    rescale = shared_max.sub_(top).exp_()
    own_weights = own.sub_(top).exp_()
    numerator = torch.matmul(own_weights, values[:, :, shared:]).add_(shared_out * rescale)
    denominator = own_weights.sum(dim=-1, keepdim=True).add_(shared_sum * rescale)
    return numerator.div_(denominator).view(rows, heads, 1, dim)
