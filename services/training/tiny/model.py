"""The tiny family's model: a small decoder-only GPT over bytes, and its rollouts.

The model is nanoGPT's shape, written to be read top to bottom: token embeddings,
``n_layer`` pre-norm blocks (causal self-attention, GELU MLP), a final LayerNorm and an
untied output head (tied weights would share storage; a checkpoint stores every tensor
exactly once by name). Positions are rotary (RoPE, as in nanochat and most current LLMs)
rather than learned: attention then sees *relative* offsets, so "attend to the token after
the one that matches" — the induction-head copy that reading a tool name out of the
listing needs — is learned in a few hundred steps instead of thousands.

Rollouts of training and evaluation go through the inference engine
(:class:`services.inference.tiny.TinyEngine`, driven by the family,
:mod:`services.training.tiny.family`), as serving does. :meth:`TinyModel.generate`
is the model's own batched sampler, kept for single transcripts (``act``) and for scripted
policies that override it: prompts of different lengths are left-padded, every row carries
its own position ids (so padding never shifts a token's position) and a key mask (so no row
attends to padding), and decoding reuses a key/value cache. Sampling draws Gumbel noise
from :mod:`services.training.rng`, keyed by each row's
seed and the token index, so a row's sample does not depend on its batch neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn

from services.environments.base import Environment, Episode, TaskSpec
from services.training.checkpoint import CheckpointError, load_checkpoint
from services.training.device import autocast, resolve_device
from services.training.family import Rollouts, TokenEpisode, TokenTurn
from services.training.rng import derive_seed, gumbel
from services.training.tiny.rollout import run_episodes
from services.training.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. The defaults are the toolcalc reference policy (~0.5M parameters)."""

    vocab_size: int = 256
    max_seq_len: int = 192
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 96
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError("GPTConfig.d_model must be divisible by n_head")

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": "ratchet-gpt", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        if data.get("architecture", "ratchet-gpt") != "ratchet-gpt":
            raise ValueError(f"unknown architecture {data.get('architecture')!r}")
        fields = {k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**fields)


class KVCache:
    """Keys and values of every layer for the positions decoded so far."""

    def __init__(self, config: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype):
        head_dim = config.d_model // config.n_head
        shape = (config.n_layer, batch, config.n_head, config.max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, H, S, Dh)
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, H, S, Dh)
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (B, H, T, Dh) for the new positions; returns all positions so far (B, H, S, Dh)
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k.to(self.k.dtype)
        self.v[layer, :, :, self.length : end] = v.to(self.v.dtype)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


def rotary_tables(
    config: GPTConfig, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, Dh/2) for rotary position embeddings (base 10000)."""
    head_dim = config.d_model // config.n_head
    inv_freq = 1.0 / (
        10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    )
    angles = torch.outer(
        torch.arange(config.max_seq_len, dtype=torch.float32, device=device), inv_freq
    )
    return angles.cos(), angles.sin()  # (S, Dh/2) each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (B, H, T, Dh) by position; cos/sin are (B, 1, T, Dh/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, Dh/2) each
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, H, T, Dh)
    return rotated.to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        B, T, C = x.shape  # noqa: N806 - shape names
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)  # (B, H, T, Dh)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, H, S, Dh)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, Dh)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.down = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rotary, mask, cache, layer)  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer over byte ids."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S, Dh/2), not a weight
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps early activations tame.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for token ids ``idx`` (B, T).

        ``pos`` (B, T) defaults to 0..T-1; ``mask`` (B, 1, T, S) is a boolean "may attend"
        mask and defaults to causal; ``cache`` holds the keys/values of earlier positions.
        """
        B, T = idx.shape  # noqa: N806 - shape names
        if pos is None:
            pos = torch.arange(T, device=idx.device).expand(B, T)  # (B, T)
        rotary = (self.rope_cos[pos][:, None], self.rope_sin[pos][:, None])  # 2 x (B, 1, T, Dh/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, rotary, mask, cache, layer)  # (B, T, C)
        if cache is not None:
            cache.advance(T)
        return self.head(self.ln_f(x))  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def token_logprobs(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """log p(idx[:, t+1] | idx[:, :t+1]) for every position: (B, T-1), float32.

    Right padding needs no mask: a causal model never lets a real token see the padding
    after it, and the caller masks the padded targets out of the loss.
    """
    logits = model(idx[:, :-1]).float()  # (B, T-1, V)
    logp = torch.log_softmax(logits, dim=-1)  # (B, T-1, V)
    return logp.gather(-1, idx[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)


@torch.no_grad()
def generate_ids(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seeds: Sequence[int],
    stop_id: int,
    device: torch.device,
) -> list[list[int]]:
    """Sample continuations of each prompt until ``stop_id`` (excluded) or ``max_new_tokens``.

    Prompts longer than the context allows keep their last tokens.
    """
    config = model.config
    if not prompts:
        return []
    if max_new_tokens < 1 or max_new_tokens >= config.max_seq_len:
        raise ValueError(f"max_new_tokens must be in [1, {config.max_seq_len - 1}]")
    keep = config.max_seq_len - max_new_tokens
    rows = [list(p)[-keep:] or [stop_id] for p in prompts]
    B, P = len(rows), max(len(r) for r in rows)  # noqa: N806 - shape names

    idx = torch.zeros(B, P, dtype=torch.long, device=device)  # (B, P) left-padded
    valid = torch.zeros(B, config.max_seq_len, dtype=torch.bool, device=device)  # (B, S)
    for b, row in enumerate(rows):
        idx[b, P - len(row) :] = torch.tensor(row, device=device)
        valid[b, P - len(row) : P] = True
    pos = (valid[:, :P].long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)

    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()  # (P, P)
    eye = torch.eye(P, dtype=torch.bool, device=device)  # pad rows see themselves: no NaN
    prefill_mask = causal & (valid[:, None, :P] | eye)  # (B, P, P)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = KVCache(config, B, device, dtype)
    row_seeds = torch.tensor([s & 0xFFFFFFFF for s in seeds], dtype=torch.int64, device=device)

    with autocast(device):
        logits = model(idx, pos, prefill_mask[:, None], cache)[:, -1].float()  # (B, V)
    next_pos = pos[:, -1] + 1  # (B,)
    out = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)  # (B, N)
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # (B,)
    for t in range(max_new_tokens):
        if temperature <= 0:
            token = logits.argmax(dim=-1)  # (B,)
        else:
            noise = gumbel(row_seeds, t, logits.shape[-1])  # (B, V)
            token = (logits.double() / temperature + noise).argmax(dim=-1)  # (B,)
        out[:, t] = token
        stopped = (token == stop_id) & ~finished
        lengths = torch.where(stopped, torch.full_like(lengths, t), lengths)
        finished |= stopped
        if bool(finished.all()) or t == max_new_tokens - 1:
            break
        valid[:, P + t] = True
        mask = valid[:, None, None, : P + t + 1]  # (B, 1, 1, S)
        with autocast(device):
            logits = model(token[:, None], next_pos[:, None], mask, cache)[:, -1].float()
        next_pos = next_pos + 1
    out_cpu, lengths_cpu = out.cpu().tolist(), lengths.cpu().tolist()
    return [row[:n] for row, n in zip(out_cpu, lengths_cpu, strict=True)]


class TinyModel:
    """A loaded tiny-family model that turns transcripts into next turns, for evaluation,
    GRPO rollouts and serving (the ``hf`` family's counterpart is ``HFModel``)."""

    def __init__(
        self,
        model: GPT,
        *,
        tokenizer: ByteTokenizer | None = None,
        device: torch.device | None = None,
        checkpoint_id: str | None = None,
    ):
        self.device = device or next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.checkpoint_id = checkpoint_id

    @classmethod
    def load(cls, checkpoint_dir: Path | str, device: str = "auto") -> TinyModel:
        """Load and verify a checkpoint directory (sha256 of every file) onto ``device``."""
        loaded = load_checkpoint(checkpoint_dir)
        try:
            config = GPTConfig.from_dict(loaded.config)
            model = GPT(config)
            model.load_state_dict(loaded.state_dict)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint_dir} does not fit the tiny model: {exc}"
            ) from exc
        return cls(
            model,
            tokenizer=loaded.tokenizer,
            device=resolve_device(device),
            checkpoint_id=loaded.manifest.checkpoint_id,
        )

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | Sequence[int] = 0,
    ) -> list[str]:
        """Continue each prompt up to the stop byte (a newline); ``temperature=0`` is greedy.

        ``seed`` is one run seed (row ``i`` uses ``derive_seed(seed, i)``) or one seed per row.
        """
        if isinstance(seed, int):
            seeds = [derive_seed(seed, i) for i in range(len(prompts))]
        else:
            seeds = list(seed)
            if len(seeds) != len(prompts):
                raise ValueError("need one seed per prompt")
        ids = generate_ids(
            self.model,
            [self.tokenizer.encode(p) for p in prompts],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seeds=seeds,
            stop_id=self.tokenizer.stop_id,
            device=self.device,
        )
        return [self.tokenizer.decode(row) for row in ids]

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,
    ) -> Rollouts:
        """One verified episode per task, episode ``i`` sampled from ``seeds[i]``, through
        :meth:`generate` (:func:`services.training.tiny.rollout.run_episodes`).

        This is the reference path, and the one a subclass that scripts :meth:`generate`
        (tests replay demonstrations that way) rolls out through. Training and evaluation
        roll the network out through the inference engine instead
        (:meth:`services.training.tiny.family.TinyFamilyModel.rollouts`), which gives the
        same token record and, for the network itself, the same tokens. Episodes run in
        lockstep batches of ``max_rows`` (None: all at once)."""
        rows = len(tasks) if max_rows is None else max_rows
        if rows < 1:
            raise ValueError("max_rows must be >= 1")
        records: list[tuple[Episode, list[TokenTurn]]] = []
        generated = prompt_tokens = 0
        for begin in range(0, max(len(tasks), 1), rows):
            rollouts, stats = run_episodes(
                env,
                tasks[begin : begin + rows],
                self,
                seeds=seeds[begin : begin + rows],
                max_turns=max_turns,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                context_limit=self.model.config.max_seq_len,
            )
            records += [(r.episode, r.turns) for r in rollouts]
            generated += stats.generated_tokens
            prompt_tokens += stats.prompt_tokens
        return verified_rollouts(env, tasks, records, generated, prompt_tokens)

    def act(self, transcript: str) -> str:
        """Greedy next turn for one transcript: usable as ``Environment.run_episode``'s ``act``."""
        return self.generate([transcript])[0]

    def actor(
        self, *, temperature: float = 0.0, seed: int = 0, max_new_tokens: int = 32
    ) -> Callable[[str], str]:
        """An ``act`` callable with sampling settings; each call draws fresh noise."""
        calls = 0

        def act(transcript: str) -> str:
            nonlocal calls
            calls += 1
            return self.generate(
                [transcript],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=[derive_seed(seed, calls)],
            )[0]

        return act


def verified_rollouts(
    env: Environment,
    tasks: Sequence[TaskSpec],
    records: Sequence[tuple[Episode, list[TokenTurn]]],
    generated_tokens: int,
    prompt_tokens: int,
) -> Rollouts:
    """Rolled-out episodes and their token turns, scored by the environment's verifier."""
    episodes = [
        TokenEpisode(
            task=task,
            turns=turns,
            reward=env.verify(task, episode),
            end_reason=episode.end_reason,
            answer=episode.final_answer,
        )
        for task, (episode, turns) in zip(tasks, records, strict=True)
    ]
    return Rollouts(episodes, generated_tokens, prompt_tokens)
