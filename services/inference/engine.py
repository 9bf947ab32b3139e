"""The one inference engine: what a model family provides, and the decode loop they share.

Serving (:mod:`services.modelserver.scheduler`), training rollouts and evaluation
(:mod:`services.inference.rollout`) all decode through :class:`ActiveBatch`, so every
token of a served request, a rollout and an evaluation is computed the same way, once.

A *model family engine* (:class:`Engine`) turns chat messages into token ids with the
family's template and runs its model over the keys/values the engine owns
(:class:`BatchForward`: one call writes the new tokens' keys and values into given columns
of given rows of the engine's buffers and attends to the columns before them). The engine
does the rest, the same for every family:

- **a preallocated cache**: each layer's keys and values live in one buffer (L, R, H, S, D);
  a decode step writes one column per row in place (no concatenation of the whole cache per
  step). The buffer is sized for the joining rows' prompts and their first tokens and
  doubles when rows or columns run out, so a long budget costs memory only as it decodes.
  Rows are left-aligned (row ``b``'s token ``t`` sits in column ``t`` at position ``t``), so
  a row joining needs no shift of the others and a row leaving moves only the rows after
  it, once.
- **prefix reuse**: a joining row's prompt is looked up in the engine's
  :class:`~services.inference.prefix_cache.PrefixCache` (keyed by ``Engine.prefix_key``:
  model, adapter and adapter load) and only the part after the longest cached prefix is
  prefilled; its full blocks are stored for the rows after it.
- **episodes that keep their KV**: a request with a :class:`Session` stores its whole
  conversation (prompt and completion) when it finishes and pins it, so the episode's next
  turn prefills only the tool result and the new turn's header.
- **what was sampled, exactly**: every result carries the sampled ids (the stop token
  included when one was sampled) and each one's log-probability under the model
  (``log_softmax`` of its logits, temperature 1), which training scores as they are.

Each forward step makes one new token for every row, each row sampled with its own
temperature, top-p and seed and stopping on its own stop ids, stop strings or token budget.
Rows join between steps and leave as soon as they finish (continuous batching, as vLLM
schedules). Sampling is Gumbel-max on nucleus-masked logits with counter-based noise keyed
by the row's seed and the row's own token count (:mod:`services.training.rng`), so a seeded
request gets the same tokens whatever else shares its batch and whenever it joined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from services.chat.protocol import ChatMessage
from services.inference.forward import BatchForward, ForwardCall, KVLayout
from services.inference.prefix_cache import Block, PrefixCache
from services.inference.requests import (
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SampledToken,
    SamplingParams,
    TokenCallback,
    cut_at_stop,
)
from services.inference.sampling import sample_next, top_logprobs
from services.inference.utilisation import TimeSplit

# The request and result types live in services.inference.requests; they are named here too,
# where the engine's callers have always imported them from.
__all__ = [
    "ActiveBatch",
    "Engine",
    "EngineError",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "SampledToken",
    "SamplingParams",
    "TokenCallback",
    "cut_at_stop",
]


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
    prefix_cache: PrefixCache

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids for a conversation, ending where the assistant's turn begins."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Ids of a raw text prompt (``/v1/completions``), no chat template."""
        ...

    def decode_text(self, ids: Sequence[int]) -> str: ...

    def parse_reply(self, text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
        """The assistant message in generated ``text``: tool calls, else content."""
        ...

    def forward(self, adapters: Sequence[str | None]) -> BatchForward:
        """Model calls for a batch whose first rows use ``adapters`` (None: the base model)."""
        ...

    def kv_layout(self) -> KVLayout: ...

    def prefix_key(self, adapter: str | None) -> Hashable:
        """What computed a prefix under ``adapter``: its keys are reused only under this key."""
        ...

    def adapters(self) -> frozenset[str]:
        """Resident adapter names on this engine's base model."""
        ...

    def context_length(self) -> int: ...

    def vocab_size(self) -> int:
        """Token ids this model embeds: ``[0, vocab_size)`` (a prompt of ids is checked)."""
        ...


Tag = TypeVar("Tag")

HEADROOM = 256  # decode columns reserved when rows join, before the buffers grow
SHORT_PREFILL = 64  # uncached tokens below which padding a row into a call costs little


@dataclass
class _Row(Generic[Tag]):
    request: GenerationRequest
    tag: Tag
    budget: int
    fed: list[int]  # the tokens whose keys/values are in the row's cache columns [0, len)
    cached: int = 0
    # The serials of the prefix cache's full blocks that hold the row's columns from 0 on,
    # bit for bit (copied into the row, or stored from it): what rows may share.
    origin: tuple[int, ...] = ()
    generated: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish: FinishReason | None = None


class ActiveBatch(Generic[Tag]):
    """Rows of one engine decoding together; rows join between steps and leave when done.

    Each row carries a ``tag`` (the scheduler's handle for its request) that comes back with
    its result. Not thread-safe: one decode thread owns it.
    """

    def __init__(self, engine: Engine, *, split: TimeSplit | None = None) -> None:
        self.engine = engine
        self.split = split  # where the model calls' and sampling's seconds go, if measured
        self._forward: BatchForward | None = None
        self._rows: list[_Row[Tag]] = []  # row b's cache is buffer row b
        # (B, V) each row's next-token logits, on the model's device: sampling runs there and
        # only the sampled ids and their log-probs travel to the host
        self._logits: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None  # (L, R, H, S, D)
        self._values: torch.Tensor | None = None  # (L, R, H, S, D)
        self._shared = 0  # columns [0, n) every row holds the same keys and values in

    def __len__(self) -> int:
        return sum(1 for row in self._rows if row.finish is None)

    def can_join(self) -> bool:
        """Rows may always join between steps."""
        return True

    def budget(self, request: GenerationRequest) -> int:
        """The tokens ``request`` may still make; EngineError if its prompt fills the context."""
        limit = self.engine.context_length()
        if not request.prompt_ids:
            raise EngineError("the prompt is empty")
        if len(request.prompt_ids) >= limit:
            raise EngineError(
                f"the prompt is {len(request.prompt_ids)} tokens; this model's context is "
                f"{limit} tokens"
            )
        return min(request.sampling.max_tokens, limit - len(request.prompt_ids))

    @torch.no_grad()
    def join(self, requests: Sequence[tuple[GenerationRequest, Tag]]) -> None:
        """Prefill ``requests`` (each passed :meth:`budget`) and add them to the batch.

        Rows are prefilled in waves, each wave's rows batched into a few model calls: a row
        that shares more of its prompt with a row of the current wave than the prefix cache
        holds waits for the next wave, where that shared part is a cache hit. So a GRPO group
        with one prompt, or a batch of prompts that start with one system text, computes
        the shared part once and the rest of every prompt in one call."""
        if not requests:
            return
        rows = [_Row(request, tag, self.budget(request), []) for request, tag in requests]
        if self._forward is None:
            self._forward = self.engine.forward([row.request.adapter for row in rows])
        # Room for the prompts and the first tokens; decoding grows it (doubling) as it goes,
        # so a row asking for a long budget costs memory only for what it decodes.
        need = max(len(row.request.prompt_ids) + min(row.budget, HEADROOM) for row in rows)
        self._reserve(len(self._rows) + len(rows), need)
        pending = rows
        while pending:
            wave, pending = self._next_wave(pending)
            for call in _prefill_calls(wave, self.engine.context_length()):
                joined = self._prefill(call)  # (B2, V)
                self._logits = joined if self._logits is None else torch.cat([self._logits, joined])
        self._shared = self._shared_columns()

    def _next_wave(self, pending: list[_Row[Tag]]) -> tuple[list[_Prefill[Tag]], list[_Row[Tag]]]:
        """The rows to prefill now (with the cached prefix each starts from) and the rows
        that wait: those that would find more of their prompt cached once this wave is in."""
        cache = self.engine.prefix_cache
        block = cache.block_tokens
        wave: list[_Prefill[Tag]] = []
        later: list[_Row[Tag]] = []
        for row in pending:
            prompt = row.request.prompt_ids
            namespace = self.engine.prefix_key(row.request.adapter)
            blocks = cache.lookup(namespace, prompt, len(prompt) - 1)
            cached = sum(len(b.tokens) for b in blocks)
            limit = len(prompt) - 1
            gain = max(
                (
                    _common_prefix(prompt, other.row.request.prompt_ids, limit) // block * block
                    for other in wave
                    if other.namespace == namespace
                ),
                default=0,
            )
            if gain > cached:
                later.append(row)
            else:
                wave.append(_Prefill(row, namespace, blocks, cached))
        return wave, later

    def _prefill(self, rows: list[_Prefill[Tag]]) -> torch.Tensor:
        """Prefill ``rows`` in one model call, each on top of its cached prefix, into the
        next free buffer rows; their last prompt positions' logits (B, V).

        Each row's uncached tokens are left-padded to the call's length, so every row's last
        prompt token is the call's last position (the one whose logits a family returns).
        A pad sits at a position after its row's prompt: its keys/values land in columns the
        row's decoding overwrites before it reads them, and no prompt token attends to it."""
        assert self._forward is not None
        first = len(self._rows)
        cache = self.engine.prefix_cache
        # Looked up again: an insert of an earlier call may have evicted a block seen before.
        found = [
            cache.lookup(p.namespace, p.row.request.prompt_ids, len(p.row.request.prompt_ids) - 1)
            for p in rows
        ]
        starts = [sum(len(b.tokens) for b in blocks) for blocks in found]
        prompts = [p.row.request.prompt_ids for p in rows]
        length = max(len(prompt) - at for prompt, at in zip(prompts, starts, strict=True))
        pads = [length - (len(prompt) - at) for prompt, at in zip(prompts, starts, strict=True)]
        columns_needed = max(len(p) + n for p, n in zip(prompts, pads, strict=True))
        if len(rows) > 1 and columns_needed > self.engine.context_length():
            # A lookup found more cached than the wave saw: pads would run past the context.
            return torch.cat([self._prefill(rows[:1]), self._prefill(rows[1:])])
        self._reserve(first + len(rows), columns_needed)
        assert self._keys is not None and self._values is not None
        ids, positions = [], []
        for index, (prompt, blocks, at, n) in enumerate(
            zip(prompts, found, starts, pads, strict=True)
        ):
            column = 0
            for block in blocks:
                assert block.keys is not None and block.values is not None
                end = column + len(block.tokens)
                self._keys[:, first + index, :, column:end] = block.keys
                self._values[:, first + index, :, column:end] = block.values
                column = end
            ids.append([prompt[-1]] * n + prompt[at:])
            positions.append([*range(len(prompt), len(prompt) + n), *range(at, len(prompt))])
        device = self.engine.device
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)  # (B, T)
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)  # (B, T)
        width = int(positions_t.max()) + 1
        columns = torch.arange(width, device=device)  # (W,)
        mask = (columns[None, None, :] <= positions_t[:, :, None])[:, None]  # (B, 1, T, W)
        chosen = [item.row for item in rows]
        call = self._call(ids_t, positions_t, slice(first, first + len(rows)), width, mask, *chosen)
        logits = self._model(call, pads=sum(pads))  # (B, V)
        for index, (item, at, copied) in enumerate(zip(rows, starts, found, strict=True)):
            row = item.row
            row.fed, row.cached = list(row.request.prompt_ids), at
            self._rows.append(row)
            row.origin = self._store_prompt(item.namespace, row.fed, first + index, copied)
        return logits

    def _store_prompt(
        self, namespace: Hashable, prompt: list[int], slot: int, copied: list[Block]
    ) -> tuple[int, ...]:
        """Store the full blocks of the prompt in buffer row ``slot`` in the prefix cache; the
        serials of those that hold the row's columns bit for bit, from column 0 on: the blocks
        copied into the row, then the ones stored from it. A block another row stored first
        holds keys computed in another call, equal only to rounding, and ends the run."""
        cache = self.engine.prefix_cache
        reader, computed = self._reader(slot), set()

        def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            computed.add(start)
            return reader(start, end)

        origin: list[int] = []
        for index, block in enumerate(cache.insert(namespace, prompt, read)):
            was_copied = index < len(copied) and copied[index] is block
            if not (was_copied or index * cache.block_tokens in computed):
                break
            origin.append(block.serial)
        return tuple(origin)

    def _shared_columns(self) -> int:
        """Columns ``[0, n)`` in which every row holds the same keys and values: the blocks
        at the start of every row's origin (a decode step's attention may read them once)."""
        if len(self._rows) < 2:
            return 0
        first, *others = (row.origin for row in self._rows)
        blocks = 0
        for index, serial in enumerate(first):
            if any(len(origin) <= index or origin[index] != serial for origin in others):
                break
            blocks = index + 1
        return blocks * self.engine.prefix_cache.block_tokens

    def _call(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: slice,
        width: int,
        mask: torch.Tensor,
        *only: _Row[Tag],
        shared: int = 0,
    ) -> ForwardCall:
        assert self._keys is not None and self._values is not None
        chosen = only or tuple(self._rows)
        return ForwardCall(
            ids=ids,
            positions=positions,
            rows=rows,
            width=width,
            mask=mask,
            keys=self._keys,
            values=self._values,
            adapters=[row.request.adapter for row in chosen],
            shared=shared,
        )

    def _reader(self, slot: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            assert self._keys is not None and self._values is not None
            keys = self._keys[:, slot, :, start:end].clone()  # (L, H, n, D)
            return keys, self._values[:, slot, :, start:end].clone()

        return read

    def _reserve(self, rows: int, columns: int) -> None:
        """Buffers for at least ``rows`` rows of ``columns`` positions (grown, never per step).

        Columns double on a CPU (few copies); on a GPU they grow by :data:`HEADROOM`, as a
        thousand rows' buffer there is tens of GB and the old one lives while it is copied."""
        have_rows = 0 if self._keys is None else self._keys.shape[1]
        have_columns = 0 if self._keys is None else self._keys.shape[3]
        if rows <= have_rows and columns <= have_columns:
            return
        layout = self.engine.kv_layout()
        device = self.engine.device
        new_rows = rows if rows <= have_rows else max(rows, 2 * have_rows)
        grown = have_columns + HEADROOM if device.type == "cuda" else 2 * have_columns
        new_columns = have_columns if columns <= have_columns else max(columns, grown)
        new_columns = min(new_columns, self.engine.context_length())
        shape = (layout.layers, new_rows, layout.heads, new_columns, layout.head_dim)
        keys = torch.zeros(shape, dtype=layout.dtype, device=device)
        values = torch.zeros(shape, dtype=layout.dtype, device=device)
        if self._keys is not None and self._values is not None and self._rows:
            live, width = len(self._rows), max(len(row.fed) for row in self._rows)
            keys[:, :live, :, :width] = self._keys[:, :live, :, :width]
            values[:, :live, :, :width] = self._values[:, :live, :, :width]
        self._keys, self._values = keys, values

    @torch.no_grad()
    def step(self) -> list[tuple[Tag, GenerationResult]]:
        """Sample one token for every row; the rows that finished, with their results."""
        if self._forward is None or self._logits is None:
            return []
        rows = self._rows
        logits = self._logits
        with self._part("sampling"):
            tokens, logprobs, tops = self._sample(rows, logits)
        done: list[tuple[Tag, GenerationResult]] = []
        for slot, (row, token, logprob, top) in enumerate(
            zip(rows, tokens, logprobs, tops, strict=True)
        ):
            if self._advance(row, SampledToken(token, logprob, top)):
                self._keep_session(slot, row)
                done.append((row.tag, self._result(row)))
        if done:
            self._retain([b for b, row in enumerate(rows) if row.finish is None])
            tokens = [row.sampled[-1] for row in self._rows]
        if not self._rows:
            self._forward, self._logits, self._keys, self._values = None, None, None, None
            return done
        self._logits = self._model(self._decode_call(tokens))
        for row, token in zip(self._rows, tokens, strict=True):
            row.fed.append(token)
        return done

    @staticmethod
    def _sample(
        rows: list[_Row[Tag]], logits: torch.Tensor
    ) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
        """Each row's next token, its log-probability (temperature 1) and its top ids,
        computed where the logits are."""
        device = logits.device
        tokens = sample_next(
            logits,
            torch.tensor([r.request.sampling.temperature for r in rows], dtype=torch.float64).to(
                device
            ),
            torch.tensor([r.request.sampling.top_p for r in rows], dtype=torch.float64).to(device),
            torch.tensor([r.request.sampling.seed & 0xFFFFFFFF for r in rows]).to(device),
            torch.tensor([len(r.sampled) for r in rows]).to(device),  # each row's draw number
        )  # (B,)
        every = torch.log_softmax(logits.double(), dim=-1)  # (B, V)
        logprobs = every.gather(1, tokens[:, None])[:, 0]  # (B,)
        tops = top_logprobs(every, [r.request.sampling.top_logprobs for r in rows])
        return tokens.tolist(), logprobs.tolist(), tops

    def _part(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.split.part(name) if self.split is not None else contextlib.nullcontext()

    def _model(self, call: ForwardCall, *, pads: int | None = None) -> torch.Tensor:
        """One model call (a prefill when ``pads`` is given, else a decode step): its logits
        (B, V) in fp32 on the model's device, its seconds and shape counted when the batch
        is measured (on CUDA its kernels waited for, so the seconds are theirs)."""
        assert self._forward is not None
        run = self._forward.step if pads is None else self._forward.prefill
        with self._part("forward"):
            logits = run(call).float()
            if self.split is not None and logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
        if self.split is not None:
            calls = self.split.calls
            rows, tokens = call.ids.shape
            if pads is None:
                calls.decode_calls += 1
                calls.decode_rows += rows
            else:
                calls.prefill_calls += 1
                calls.prefill_rows += rows
                calls.prefill_tokens += rows * tokens
                calls.prefill_pads += pads
        return logits

    def _decode_call(self, tokens: list[int]) -> ForwardCall:
        device = self.engine.device
        lengths = torch.tensor([len(row.fed) for row in self._rows], device=device)  # (B,)
        width = int(lengths.max()) + 1
        self._reserve(len(self._rows), width)
        columns = torch.arange(width, device=device)  # (W,)
        mask = (columns[None, :] <= lengths[:, None])[:, None, None]  # (B, 1, 1, W)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]  # (B, 1)
        rows = slice(0, len(self._rows))
        return self._call(ids, lengths[:, None], rows, width, mask, shared=self._shared)

    def _retain(self, keep: list[int]) -> None:
        """Keep rows ``keep``: each buffer row a leaving row frees among the first
        ``len(keep)`` is filled by a kept row from past them, all moved in one copy, so a
        row leaving moves at most one other (a row's place in the batch changes nothing it
        computes: its sampling is keyed by its own seed and count)."""
        assert self._keys is not None and self._values is not None
        kept = len(keep)
        holes = sorted(set(range(kept)) - set(keep))
        movers = [b for b in keep if b >= kept]  # as many as the holes
        order = list(range(kept))
        if holes:
            width = max(len(self._rows[b].fed) for b in movers)
            source = torch.tensor(movers, device=self._keys.device)
            target = torch.tensor(holes, device=self._keys.device)
            self._keys[:, target, :, :width] = self._keys[:, source, :, :width]
            self._values[:, target, :, :width] = self._values[:, source, :, :width]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        self._rows = [self._rows[b] for b in order]
        self._shared = self._shared_columns()

    def _keep_session(self, slot: int, row: _Row[Tag]) -> None:
        """Store a finished row's conversation for its session's next turn."""
        session = row.request.session
        if session is None or row.finish == FinishReason.CANCELLED:
            return
        cache = self.engine.prefix_cache
        namespace = self.engine.prefix_key(row.request.adapter)
        blocks = cache.insert(namespace, row.fed, self._reader(slot), tail=True)
        cache.hold(session, blocks)

    def _advance(self, row: _Row[Tag], sampled: SampledToken) -> bool:
        """Append ``sampled`` to ``row``; whether the row is now finished."""
        if row.request.cancelled.is_set():
            row.finish = FinishReason.CANCELLED
            return True
        token = sampled.id
        row.sampled.append(token)
        row.logprobs.append(sampled.logprob)
        row.top_logprobs.append(sampled.top)
        if token in self.engine.eos_ids:
            row.finish = FinishReason.STOP
            return True
        row.generated.append(token)
        if row.request.on_token is not None:
            row.request.on_token(sampled)
        if _hit_stop_string(self.engine, row.generated, row.request.sampling.stop):
            row.finish = FinishReason.STOP
        elif len(row.generated) >= row.budget:
            row.finish = FinishReason.LENGTH
        return row.finish is not None

    @staticmethod
    def _result(row: _Row[Tag]) -> GenerationResult:
        return GenerationResult(
            token_ids=row.generated,
            finish_reason=row.finish or FinishReason.LENGTH,
            prompt_tokens=len(row.request.prompt_ids),
            cached_tokens=row.cached,
            sampled_ids=row.sampled,
            logprobs=row.logprobs,
            top_logprobs=row.top_logprobs,
        )

    def cache_width(self) -> int:
        """Positions the running batch attends to per row (its longest live row; 0 idle)."""
        return max((len(row.fed) for row in self._rows), default=0)

    def rows(self) -> list[Tag]:
        """The tags of the rows still decoding."""
        return [row.tag for row in self._rows if row.finish is None]


@dataclass
class _Prefill(Generic[Tag]):
    """A joining row with the cached blocks its prefill starts from."""

    row: _Row[Tag]
    namespace: Hashable
    blocks: list[Block]
    cached: int


def _prefill_calls(wave: list[_Prefill[Tag]], context: int) -> list[list[_Prefill[Tag]]]:
    """A wave's rows as model calls: longest uncached part first, and a row joins a call only
    while padding it to the call's length at most doubles its work (or the call is short)
    and its pads stay inside the context, so no call computes much more than its tokens."""
    order = sorted(wave, key=lambda p: len(p.row.request.prompt_ids) - p.cached, reverse=True)
    calls: list[list[_Prefill[Tag]]] = []
    for item in order:
        prompt = len(item.row.request.prompt_ids)
        uncached = prompt - item.cached
        if calls:
            call = calls[-1]
            length = len(call[0].row.request.prompt_ids) - call[0].cached
            fits = prompt + length - uncached <= context
            if fits and (2 * uncached >= length or length <= SHORT_PREFILL):
                call.append(item)
                continue
        calls.append([item])
    return calls


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading ids ``a[:limit]`` and ``b`` share."""
    n = min(limit, len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _hit_stop_string(engine: Engine, ids: list[int], stops: tuple[str, ...]) -> bool:
    if not stops:
        return False
    tail = engine.decode_text(ids[-64:])
    return any(stop in tail for stop in stops)
