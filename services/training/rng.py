"""Counter-based random numbers, so a sample depends on *what* is sampled, not *where*.

A stateful generator gives different numbers to the same episode depending on which other
episodes share its batch, which rank it landed on, or whether the run was resumed. Here a
random number is a pure hash of (episode seed, counter, index): the same episode draws the
same tokens in one process or in eight, before or after a restart, on CPU or CUDA. That is
what makes data-parallel runs and resumed runs reproduce a single uninterrupted run.

The hash is a 32-bit integer mixer (from the well-known ``0x45d9f3b`` avalanche function)
computed in int64 so no product can overflow.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B9


def _mix_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    x ^= x >> 16
    return x


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from a tuple of integers (run seed, step, task index, sample index…)."""
    h = 0x12345678
    for part in parts:
        for shift in (0, 32):
            h = _mix_int(h ^ _mix_int(((part >> shift) & _M32) + _GOLDEN))
    return h


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The mixer over a tensor, in place: ``x`` is int64 with values in [0, 2**32) and is
    overwritten (every product stays below 2**59). In place because a (B, V) draw is tens of
    megabytes: a fresh tensor per operation costs more in page faults than the arithmetic
    (measured 98 ms against 19 ms for a (64, 49152) draw, the same numbers)."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16)
        x.mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def uniform(seeds: torch.Tensor, counter: int | torch.Tensor, n: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), shape (B, n), for row seeds (B,) at draw number ``counter``
    (one for every row, or one per row: (B,))."""
    if isinstance(counter, int):
        draw: int | torch.Tensor = _mix_int(counter + 1)
    else:
        draw = _mix((counter.to(device=seeds.device, dtype=torch.int64) + 1) & _M32)  # (B,)
    row = _mix(seeds.to(torch.int64) ^ draw)  # (B,)
    idx = torch.arange(1, n + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN  # (n,)
    h = _mix((row[:, None] + idx[None, :]).bitwise_and_(_M32))  # (B, n)
    return h.to(torch.float64).add_(0.5).div_(float(1 << 32))


def gumbel(seeds: torch.Tensor, counter: int | torch.Tensor, n: int) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, n): ``argmax(logits / T + gumbel)`` samples softmax(logits / T)."""
    return uniform(seeds, counter, n).log_().neg_().log_().neg_()
