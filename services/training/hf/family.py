"""The ``hf`` family behind :class:`services.training.family.Family`: any transformers causal
LM, prompted in chat, trained as a LoRA adapter (default) or in full.

LoRA: a full champion gets a fresh adapter (``lora_r``, ``lora_alpha``,
``lora_target_modules``); an adapter champion is trained further (its own rank and
targets), so the result is again an adapter on the same full base. ``lora: false`` trains
every weight (an adapter champion is merged into its base first). For training on CUDA a
LoRA base is held in bf16 (its weights are frozen) and trainable weights in fp32, under
bf16 autocast; CPU runs fp32. For inference an adapter is merged into its base; a LoRA
trainer's own rollouts on fp32 weights decode its adapter folded into copies of the
weights it adapts (:func:`folded_adapter`), the same outputs without peft's extra products.

``sharding: fsdp`` on more than one rank shards the model with FSDP2
(:mod:`services.training.hf.fsdp`): LoRA or full, loaded rank by rank, saved in the same
format; saving (and publishing the weights for remote rollouts) is then a collective.

Log-probs project only the positions some row trains on through the output head
(``logits_to_keep``): chat prompts are mostly system text and tools, so this skips most of
the (positions x vocabulary) logits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.environments.base import Environment, TaskSpec
from services.environments.chat import as_chat_environment
from services.inference.remote import RemoteBackend, RemotePolicy
from services.inference.utilisation import ModelShape
from services.training.checkpoint import Manifest
from services.training.config import LoRAOptions
from services.training.device import autocast
from services.training.family import (
    DemonstrationOptions,
    EpisodeFeed,
    PackedBatch,
    Rollouts,
    TokenSequence,
)
from services.training.hf.checkpoint import (
    LoadedHF,
    load_hf_checkpoint,
    save_hf_checkpoint,
    save_lora_adapter,
)
from services.training.hf.fsdp import (
    ShardedModule,
    device_mesh,
    rank_by_rank,
    shard_module,
    sharding_active,
)
from services.training.hf.model import HFModel, model_dtype
from services.training.hf.rollout import demonstration_sequences
from services.training.hf.shared_prefix import shared_prefix_logprobs

MAX_NEW_TOKENS = 48  # evaluation default: a chat tool call is longer than a tiny turn
BATCH_SIZE = 32  # evaluation default: batches of chat prompts on CPU stay small


class HFFamily:
    """The registry's ``hf`` entry."""

    name = "hf"
    eval_defaults: Mapping[str, int] = {"max_new_tokens": MAX_NEW_TOKENS, "batch_size": BATCH_SIZE}

    def load(
        self,
        path: Path,
        *,
        device: torch.device,
        base_dir: Path | None = None,
        training: object | None = None,
    ) -> HFFamilyModel:
        """An hf checkpoint (a LoRA adapter onto its verified base), for inference or, given
        the trainer's config (a :class:`LoRAOptions`), with its trainable setup."""
        if training is None:
            loaded = load_hf_checkpoint(
                path, device=device, dtype=model_dtype(device), base_dir=base_dir
            )
            inference = HFModel.from_loaded(loaded, device)
            return HFFamilyModel(
                inference.model, loaded.tokenizer, device=device, loaded=loaded, lora=False
            )
        if not isinstance(training, LoRAOptions):
            raise ValueError(f"{type(training).__name__} is not an hf trainer's config")
        dtype = torch.bfloat16 if device.type == "cuda" and training.lora else torch.float32

        def load_trainable() -> tuple[LoadedHF, Any]:
            loaded = load_hf_checkpoint(
                path, device="cpu", dtype=dtype, base_dir=base_dir, trainable_adapter=training.lora
            )
            return loaded, prepare_trainable(loaded, training)

        if sharding_active(training.sharding):
            mesh = device_mesh(device)

            def load_shard() -> tuple[LoadedHF, ShardedModule]:
                loaded, module = load_trainable()
                return loaded, shard_module(module, mesh=mesh, device=device)

            loaded, shards = rank_by_rank(load_shard)
            return HFFamilyModel(
                shards.module,
                loaded.tokenizer,
                device=device,
                loaded=loaded,
                lora=training.lora,
                shards=shards,
            )
        loaded, module = load_trainable()
        return HFFamilyModel(
            module.to(device), loaded.tokenizer, device=device, loaded=loaded, lora=training.lora
        )

    def create(
        self, shape: Mapping[str, object] | None, *, seed: int, device: torch.device
    ) -> HFFamilyModel:
        raise ValueError("hf training needs a base checkpoint: set 'base_checkpoint'")


class HFFamilyModel:
    """A loaded hf model: chat rollouts, log-probs, demonstrations, save; ``shards`` when it
    is sharded over the job's ranks (then its passes, saves and rollouts are collectives)."""

    family = "hf"

    def __init__(
        self,
        module: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        loaded: LoadedHF,
        lora: bool,
        shards: ShardedModule | None = None,
    ):
        self.module = module
        self.device = device
        self.loaded = loaded
        self.lora = lora
        self.shards = shards
        self.sharded = shards is not None
        self.checkpoint_id: str | None = loaded.manifest.checkpoint_id
        self.chat = HFModel(module, tokenizer, device=device, manifest=loaded.manifest)
        self.tokenizer = tokenizer  # HFModel gives it a pad token when it has none
        self.pad_id = int(tokenizer.pad_token_id)

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def model_shape(self) -> ModelShape:
        """What a position costs this model (a LoRA base's weights get no gradient)."""
        return ModelShape.of(self.module, frozen_weights=self.lora)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

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
        feed: EpisodeFeed | None = None,
    ) -> Rollouts:
        was_training = self.module.training
        self.module.eval()
        # a sharded model decodes locally on its gathered weights (each rank runs as many
        # passes as its episodes need); remotely, only the weights it publishes are gathered
        local = self.shards is not None and self.chat.remote is None
        gathered = self.shards.gathered() if self.shards is not None and local else nullcontext()
        fold = self.lora and self.shards is None and self.chat.remote is None
        try:
            with gathered, folded_adapter(self.module) if fold else nullcontext():
                return self.chat.rollouts(
                    env,
                    tasks,
                    seeds=seeds,
                    max_turns=max_turns,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    max_rows=max_rows,
                    feed=feed,
                )
        finally:
            self.module.train(was_training)

    def use_remote(self, backend: RemoteBackend, *, checkpoint: Path | None = None) -> None:
        """Roll out on ``backend``'s server from now on: ``checkpoint`` as the server loads
        it (an eval job's), else the weights being trained, saved for the server before
        each call's rollouts (the LoRA adapter; a full model only ``ratchet serve`` loads)."""
        if checkpoint is not None:
            self.chat.remote = RemotePolicy(backend, checkpoint=checkpoint)
        else:
            self.chat.remote = RemotePolicy(backend, publish=self._publish)

    def _publish(self, out_dir: Path) -> Manifest:
        """The weights being trained, written for the rollout server (every rank of a
        sharded model writes its own copy: each rank rolls out on its own name)."""
        metadata: dict[str, object] = {"purpose": "rollouts"}
        if self.shards is None:
            return self.save(out_dir, parent=self.checkpoint_id, metadata=metadata)
        state = self.shards.full_state(every_rank=True, trainable_only=self.lora)
        return self._write(out_dir, parent=self.checkpoint_id, metadata=metadata, state=state)

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        with autocast(self.device):
            return sequence_logprobs(
                self.module,
                batch.ids,
                batch.attention,
                batch.target,
                share_prefix=not self.sharded,
            )

    def demonstrations(
        self, env: Environment, tasks: Sequence[TaskSpec], options: DemonstrationOptions
    ) -> list[TokenSequence]:
        return demonstration_sequences(
            as_chat_environment(env),
            tasks,
            self.chat,
            recovery_fraction=options.recovery_fraction,
            seed=options.seed,
        )

    def save(self, out_dir: Path, *, parent: str | None, metadata: dict[str, object]) -> Manifest:
        """A LoRA adapter on the champion's full base, or a full model. Sharded: every rank
        calls it (the weights are gathered to rank 0, which writes), and every rank gets the
        manifest."""
        if self.shards is None:
            return self._write(out_dir, parent=parent, metadata=metadata, state=None)
        state = self.shards.full_state(every_rank=False, trainable_only=self.lora)
        written = [
            self._write(out_dir, parent=parent, metadata=metadata, state=state)
            if dist.get_rank() == 0
            else None
        ]
        dist.broadcast_object_list(written, src=0)
        manifest = written[0]
        assert manifest is not None  # rank 0 wrote it
        return manifest

    def _write(
        self,
        out_dir: Path,
        *,
        parent: str | None,
        metadata: dict[str, object],
        state: dict[str, Any] | None,
    ) -> Manifest:
        """Write the checkpoint from ``state`` (full tensors; None: the module's own)."""
        if self.lora:
            base = self.loaded.base_manifest or self.loaded.manifest
            return save_lora_adapter(
                self.module, out_dir, base=base, parent=parent, metadata=metadata, state_dict=state
            )
        return save_hf_checkpoint(
            self.module,
            self.tokenizer,
            out_dir,
            parent=parent,
            metadata=metadata,
            state_dict=state,
        )


def prepare_trainable(loaded: LoadedHF, options: LoRAOptions) -> Any:
    """The model to optimise: a (new or continued) LoRA adapter, or every weight."""
    from peft import PeftModel, get_peft_model

    model = loaded.model
    if isinstance(model, PeftModel):
        if options.lora:
            for name, param in model.named_parameters():
                param.requires_grad = "lora_" in name
            return model
        model = model.merge_and_unload()
    if not options.lora:
        model.requires_grad_(True)
        return model
    try:
        return get_peft_model(model, lora_config(options))
    except ValueError as exc:  # e.g. target modules the architecture does not have
        raise ValueError(f"cannot attach LoRA: {exc}") from None


@contextmanager
def folded_adapter(model: Any) -> Iterator[None]:
    """Run ``model``'s active LoRA adapter folded into copies of the weights it adapts, with
    peft's extra per-layer path off: the rollouts of a LoRA trainer decode as the merged
    model evaluation serves, without two more small matrix products in every adapted layer
    (measured on SmolLM2-135M's rft round, 2 CPU threads: the forward passes took 96 s
    against 110 s, the same tokens sampled).

    The weights the adapter adapts are swapped back on exit, the very tensors they were:
    no merge and unmerge that would leave them off by rounding after every round. Only fp32
    weights are folded: a bf16 base (CUDA) would round the adapter's small update away in
    the sum, so there peft's path stays (its products are cheap on a GPU anyway)."""
    from peft.tuners.lora import LoraLayer

    layers: list[Any] = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.merged]
    if any(layer.get_base_layer().weight.dtype != torch.float32 for layer in layers):
        layers = []
    originals: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight: torch.nn.Parameter = layer.get_base_layer().weight
                folded = weight.detach().clone()
                for name in layer.active_adapters:
                    if name in layer.lora_A:
                        folded += layer.get_delta_weight(name).to(folded.dtype)
                originals.append((weight, weight.data))
                weight.data = folded
        with model.disable_adapter() if layers else nullcontext():
            yield
    finally:
        for weight, data in originals:
            weight.data = data


def lora_config(options: LoRAOptions) -> Any:
    """A new adapter's peft config (also what benchmarks hand TRL, so both train the same)."""
    from peft import LoraConfig

    return LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules=list(options.lora_target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )


def sequence_logprobs(
    model: Any,
    ids: torch.Tensor,
    attention: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    share_prefix: bool = True,
) -> torch.Tensor:
    """Log-probability of each next token: (N, T-1) for ids (N, T).

    With ``target`` (N, T-1), only the positions some row trains on are projected through
    the output head (``logits_to_keep``), and (``share_prefix``) a prefix several rows share
    is computed once (:mod:`services.training.hf.shared_prefix`); other positions come back
    0. Without ``share_prefix`` it is always one call of the model (a sharded model's
    passes must be as many on every rank).
    """
    n, width = ids.shape
    if target is None or not bool(target.any()):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # (N, T-1, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, T-1, V)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    shared = shared_prefix_logprobs(model, ids, attention, target) if share_prefix else None
    if shared is not None:
        return shared
    keep = target.any(dim=0).nonzero().squeeze(-1)  # (K,) positions p predicting token p+1
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep).logits  # (N, K, V)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, K, V)
    picked = logp.gather(-1, ids[:, keep + 1, None]).squeeze(-1)  # (N, K)
    out = torch.zeros((n, width - 1), dtype=picked.dtype, device=ids.device)  # (N, T-1)
    out[:, keep] = picked
    return out
