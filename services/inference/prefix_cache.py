"""Keys and values of token prefixes, shared between rows: each prefix is computed once.

A GRPO group's rows share their whole prompt, every prompt of a loop starts with the same
system text and tool list, and each turn of an episode starts with the episode's earlier
turns. The engine looks a new row's prompt up here before prefilling it and copies the
keys/values of the longest cached prefix into the row's cache, so only the rest is
computed (as vLLM's automatic prefix caching and SGLang's radix cache do).

The cache is a trie of *blocks* of ``block_tokens`` token ids per namespace: a block is
found by its parent block and its own ids, so a hit is exact (no hash that could collide),
and a block under one namespace is never seen from another. The namespace is what computed
the keys: the engine names the model and, for an adapter, the adapter's checkpoint and the
load that put it there (see ``Engine.prefix_key``), so a prefix computed under adapter A is
never used for adapter B, nor for A after A is reloaded.

An episode between two turns holds its conversation through a :class:`Session`: the
conversation's blocks and its last, partial block (a *tail*, shorter than a block) are
pinned until the next turn has found them or the session closes. A block's reference count
is its pins plus its children (a parent cannot go before the blocks that extend it); blocks
no one references are evicted least recently used first whenever the cache would exceed
its memory budget. A block that does not fit is simply not stored: the cache changes what is
computed, never what is answered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024  # ~5,800 tokens of SmolLM2-135M in fp32
DEFAULT_BLOCK_TOKENS = 16

# Copies a row's keys and values for columns [start, end): (L, H, n, D) each.
ReadKV = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Block:
    """Keys and values (L, H, n, D) of ``tokens``, which follow the parent block's tokens."""

    serial: int
    parent: Block | None
    tokens: tuple[int, ...]
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)  # full blocks
    tails: dict[tuple[int, ...], Block] = field(default_factory=dict)  # shorter leaves
    pins: int = 0

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() * 2

    def refs(self) -> int:
        return self.pins + len(self.children) + len(self.tails)


class Session:
    """One episode's conversation kept between its turns (see the module docstring).

    Pass it with each turn's request; close it when the episode ends so its blocks may go.
    """

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.cache: PrefixCache | None = None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.hold(self, [])


class PrefixCache:
    """A trie of KV blocks per namespace, reference-counted and evicted LRU within a budget."""

    def __init__(
        self,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._roots: dict[Hashable, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # every stored block, oldest first
        self._serials = count(1)
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, namespace: Hashable, ids: Sequence[int], limit: int) -> list[Block]:
        """The blocks of the longest cached prefix of ``ids[:limit]``, first block first."""
        with self._lock:
            node = self._roots.get(namespace)
            path: list[Block] = []
            at = 0
            n = self.block_tokens
            while node is not None:
                child = node.children.get(tuple(ids[at : at + n])) if at + n <= limit else None
                if child is None:
                    child = self._longest_tail(node, ids[at:limit])
                    if child is not None:
                        path.append(child)
                    break
                path.append(child)
                at += n
                node = child
            for block in path:
                self._lru.move_to_end(block.serial)
            return path

    def insert(
        self, namespace: Hashable, ids: Sequence[int], read: ReadKV, *, tail: bool = False
    ) -> list[Block]:
        """Store the blocks of ``ids`` not stored yet (their keys/values from ``read``); with
        ``tail``, the last partial block too. The stored path, as far as the budget allowed."""
        with self._lock:
            node = self._roots.setdefault(namespace, Block(0, None, ()))
            path: list[Block] = []
            n = self.block_tokens
            at = 0
            while at < len(ids):
                tokens = tuple(ids[at : at + n])
                full = len(tokens) == n
                if not full and not tail:
                    break
                shelf = node.children if full else node.tails
                child = shelf.get(tokens)
                if child is None:
                    child = self._store(node, shelf, tokens, read, at)
                    if child is None:
                        break
                self._lru.move_to_end(child.serial)
                path.append(child)
                if not full:
                    break
                node, at = child, at + n
            return path

    def hold(self, session: Session, blocks: list[Block]) -> None:
        """Pin ``blocks`` for ``session`` and release what it held before."""
        with self._lock:
            for block in blocks:
                block.pins += 1
            for block in session.blocks:
                block.pins -= 1
            session.blocks, session.cache = list(blocks), self
            self._evict(0)

    def clear(self) -> None:
        """Forget every unpinned block (the model's weights changed under the same key)."""
        with self._lock:
            budget, self.budget_bytes = self.budget_bytes, 0
            self._evict(0)
            self.budget_bytes = budget

    # Internals ---------------------------------------------------------------------------

    @staticmethod
    def _longest_tail(node: Block, rest: Sequence[int]) -> Block | None:
        best: Block | None = None
        for tokens, block in node.tails.items():
            fits = len(tokens) <= len(rest) and tuple(rest[: len(tokens)]) == tokens
            if fits and (best is None or len(tokens) > len(best.tokens)):
                best = block
        return best

    def _store(
        self,
        parent: Block,
        shelf: dict[tuple[int, ...], Block],
        tokens: tuple[int, ...],
        read: ReadKV,
        start: int,
    ) -> Block | None:
        keys, values = read(start, start + len(tokens))
        block = Block(next(self._serials), parent, tokens, keys, values)
        parent.pins += 1  # the parent stays while room is made for its child
        try:
            if not self._evict(block.nbytes):
                return None
        finally:
            parent.pins -= 1
        shelf[tokens] = block
        self._lru[block.serial] = block
        self.bytes += block.nbytes
        return block

    def _evict(self, room: int) -> bool:
        """Evict unreferenced blocks, oldest first, until ``room`` more bytes fit the budget."""
        while self.bytes + room > self.budget_bytes:
            victim = next((b for b in self._lru.values() if b.refs() == 0), None)
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _remove(self, block: Block) -> None:
        parent = block.parent
        assert parent is not None
        shelf = parent.children if len(block.tokens) == self.block_tokens else parent.tails
        if shelf.get(block.tokens) is block:
            del shelf[block.tokens]
        del self._lru[block.serial]
        self.bytes -= block.nbytes
        self.evictions += 1
        block.keys = block.values = None
