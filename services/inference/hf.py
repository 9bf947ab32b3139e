"""The ``hf`` family behind the OpenAI API: a transformers causal LM with resident LoRA adapters.

One base model is loaded once; any number of peft LoRA adapters trained on it are loaded
beside it, each under its own served name. A batch may mix rows of different adapters and
of the base model: peft's ``adapter_names`` routes every row through its own adapter in the
same forward pass (``"__base__"`` skips the adapters), so swapping which adapter a name
serves never stops the batch, and several versions of a model cost one base in memory.

Prompts are the tokenizer's chat template, given ``tools=`` when the template renders tools
and otherwise the fallback system prompt of :mod:`services.chat.render`; replies are parsed
by :func:`services.chat.toolcalls.parse_assistant_output`, the parser training and
evaluation use, so what is served is what was trained and measured.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from services.chat.protocol import ChatMessage
from services.chat.render import messages_with_tools_prompt
from services.chat.stops import stop_token_ids
from services.chat.toolcalls import parse_assistant_output
from services.inference.cascade import cascade_attention, worth_cascading
from services.inference.engine import EngineError
from services.inference.forward import BatchForward, ForwardCall, KVLayout, write_columns
from services.inference.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache
from services.training.checkpoint import (
    CheckpointError,
    Manifest,
    read_regular_bytes,
    verify_family,
)
from services.training.device import resolve_device
from services.training.hf.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_hf_checkpoint
from services.training.hf.kv_cache import cache_keyword

FAMILY = "hf"
BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


def verify_hf(path: Path) -> Manifest:
    """Verify an hf checkpoint (every file against its manifest, no pickle): its manifest."""
    return verify_family(path, FAMILY)


class HFEngine:
    """A transformers causal LM (the base) and the LoRA adapters resident on it."""

    family = FAMILY

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        path: Path | str,
        version: str,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.model = model
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._weights = 0  # bumped when the weights change in place
        self._loads: dict[str, int] = {}  # adapter name -> the load that put it there
        self._load_count = 0
        self.tokenizer = tokenizer
        self.path = str(path)
        self.version = version
        self.device = next(model.parameters()).device
        self._adapters: dict[str, str] = {}  # adapter name -> checkpoint id
        self._peft: Any = None
        self._idle: str | None = None  # an unloaded adapter peft still holds (see _drop)
        self._lock = threading.Lock()  # adapter loads vs. batch forward passes
        # The turn ends where evaluation ends it (services.chat.stops): at <|im_end|> and the
        # template's end-of-turn token too, whatever eos the tokenizer and config name.
        self.eos_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self._template_takes_tools = _template_renders_tools(tokenizer)
        # A token's string in the vocabulary is never shorter than the text it decodes to.
        self.max_chars_per_token = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        self._cache_kwarg = cache_keyword(model)
        # Decode steps over a prefix every row shares cascade (services.inference.cascade)
        # where the model runs transformers' sdpa, whose answers the cascade's equal.
        self._cascades = getattr(model.config, "_attn_implementation", None) == "sdpa"

    @classmethod
    def load(cls, path: Path, *, device: str = "auto") -> HFEngine:
        """Load a full hf checkpoint, verified by :func:`load_hf_checkpoint` (the format of
        docs/models.md: manifest of every file, safetensors only, nothing from a hub)."""
        refuse_unsupported_architecture(path)
        target = resolve_device(device)
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
        loaded = load_hf_checkpoint(path, device=target, dtype=dtype)
        if loaded.manifest.kind != "full":
            raise CheckpointError(f"{path} is a LoRA adapter; serve its base and load it on top")
        tokenizer = loaded.tokenizer
        if tokenizer.chat_template is None:
            raise CheckpointError(f"{path} has no chat template in its tokenizer files")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        loaded.model.eval()
        return cls(loaded.model, tokenizer, path=path, version=loaded.manifest.checkpoint_id)

    # Adapters ----------------------------------------------------------------------------

    def adapters(self) -> frozenset[str]:
        return frozenset(self._adapters)

    def adapter_version(self, name: str) -> str | None:
        return self._adapters.get(name)

    def load_adapter(self, name: str, path: Path) -> str:
        """Load the LoRA adapter checkpoint at ``path`` as adapter ``name``; its id.

        The adapter's files are verified against its manifest and its base must be this
        engine's model; its config and weights are read as regular files only."""
        from peft import LoraConfig, PeftModel, set_peft_model_state_dict
        from safetensors.torch import load as safetensors_load

        manifest = verify_hf(path)
        if manifest.kind != "lora" or manifest.base is None:
            raise CheckpointError(f"{path} is not a LoRA adapter checkpoint")
        if manifest.base.checkpoint_id != self.version:
            raise CheckpointError(
                f"adapter {path} was trained on {manifest.base.checkpoint_id[:12]}, this "
                f"server's base model is {self.version[:12]}"
            )
        try:
            raw = json.loads(read_regular_bytes(path / ADAPTER_CONFIG))
            if raw.get("peft_type", "LORA") != "LORA":
                raise CheckpointError(f"adapter {path} is not a LoRA adapter")
            known = set(LoraConfig.__dataclass_fields__)
            config = LoraConfig(**{k: v for k, v in raw.items() if k in known})
            config.base_model_name_or_path = None
            config.inference_mode = True
            weights = safetensors_load(read_regular_bytes(path / ADAPTER_WEIGHTS))
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"cannot read LoRA adapter {path}: {exc}") from exc
        with self._lock:
            try:
                if self._peft is None:
                    self._peft = PeftModel(self.model, config, adapter_name=name)
                else:
                    self._peft.add_adapter(name, config)
                result = set_peft_model_state_dict(self._peft, weights, adapter_name=name)
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"cannot load LoRA adapter {path}: {exc}") from exc
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                self._peft.delete_adapter(name)
                raise CheckpointError(
                    f"LoRA adapter {path} has weights its base does not fit: {unexpected[:3]}"
                )
            self._peft.eval()
            self._adapters[name] = manifest.checkpoint_id
            self._load_count += 1
            self._loads[name] = self._load_count
            if self._idle is not None:
                idle, self._idle = self._idle, None
                self._drop(idle)
        return manifest.checkpoint_id

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                return
            del self._adapters[name]
            self._loads.pop(name, None)
            self._drop(name)

    def _drop(self, name: str) -> None:
        """Delete adapter ``name`` from peft, which must always keep one active adapter: the
        last one stays loaded (unused, never named again) until another takes its place."""
        if self._peft is None:
            return
        if not self._adapters:
            self._idle = name
            return
        self._peft.set_adapter(next(iter(self._adapters)))
        self._peft.delete_adapter(name)

    # Engine ------------------------------------------------------------------------------

    def context_length(self) -> int:
        config = self.model.config
        return int(getattr(config, "max_position_embeddings", 0) or 2048)

    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[int]:
        wire = [m.to_openai() for m in messages]
        kwargs: dict[str, Any] = {}
        if tools and self._template_takes_tools:
            kwargs["tools"] = list(tools)
        elif tools:
            wire = messages_with_tools_prompt(wire, tools)
        try:
            ids = self.tokenizer.apply_chat_template(
                wire, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
        except Exception as exc:  # jinja raises its own errors on messages a template refuses
            raise EngineError(f"the chat template refused the messages: {exc}") from exc
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode_text(self, text: str) -> list[int]:
        # special tokens (a BOS) added as vLLM adds them to a completions prompt
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=True)]

    def decode_text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def parse_reply(self, text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
        names = [tool.get("function", tool).get("name") for tool in tools]
        return parse_assistant_output(text, tool_names=[n for n in names if isinstance(n, str)])

    def kv_layout(self) -> KVLayout:
        config = self.model.config.get_text_config(decoder=True)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return KVLayout(int(config.num_hidden_layers), heads, head_dim, self.model.dtype)

    def prefix_key(self, adapter: str | None) -> Hashable:
        """The base model (and how often its weights changed in place), or the adapter's
        checkpoint and the load that put it here: a reloaded adapter starts a new key."""
        if adapter is None:
            return (FAMILY, self.version, self._weights)
        return (FAMILY, self.version, self._weights, adapter, self._loads.get(adapter))

    def weights_changed(self) -> None:
        """The model's weights were updated in place (a training step): forget its prefixes."""
        self._weights += 1
        self.prefix_cache.clear()

    def forward(self, adapters: Sequence[str | None]) -> BatchForward:
        if not _plain_dynamic_cache(self.model):
            raise EngineError(
                "this model has sliding-window attention layers, which the engine's cache "
                "does not implement; serve it with vLLM through an openai serving target"
            )
        self._check_adapters(adapters)
        cache_key = self._cache_kwarg
        layers = self.kv_layout().layers

        def call(forward: ForwardCall) -> torch.Tensor:
            self._check_adapters(forward.adapters)
            # An additive mask works with every attention implementation (eager adds it).
            mask = torch.zeros(forward.mask.shape, dtype=self.model.dtype, device=self.device)
            mask.masked_fill_(~forward.mask, torch.finfo(self.model.dtype).min)
            inputs: dict[str, Any] = {
                "input_ids": forward.ids,
                "position_ids": forward.positions,
                "attention_mask": mask,
                cache_key: _columns_cache()(forward, layers),
            }
            cascade = self._cascades and forward.shared > 0
            if cascade:
                inputs[SHARED_COLUMNS] = forward.shared
            with self._lock, _attention(self.model.config, cascade):
                # Read under the lock: an adapter load may wrap the base in peft mid-batch, and
                # from then on its layers carry LoRA, so base rows must say "__base__".
                model = self._peft if self._peft is not None else self.model
                if self._peft is not None:
                    inputs["adapter_names"] = [a or BASE_ADAPTER for a in forward.adapters]
                out = model(**inputs, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]  # (B, V)

        return BatchForward(prefill=call, step=call)

    def _check_adapters(self, adapters: Sequence[str | None]) -> None:
        missing = sorted({a for a in adapters if a is not None and a not in self._adapters})
        if missing:
            raise EngineError(f"adapter {missing[0]!r} is not loaded")


# Models whose layers keep a recurrent state instead of (or beside) keys and values: the
# engine's cache splices and cuts key/value tensors, which these do not have, so every
# request would fail. Refused at load instead.
STATE_SPACE_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "bamba",
        "zamba",
        "zamba2",
        "falcon_h1",
        "nemotron_h",
        "granitemoehybrid",
    }
)


def refuse_unsupported_architecture(path: Path) -> None:
    """CheckpointError, saying why, for a model this engine cannot decode (SSM or hybrid)."""
    try:
        config = json.loads(read_regular_bytes(path / "config.json"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"config.json of {path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"config.json of {path} is not a JSON object")
    configs = [config, *(v for v in config.values() if isinstance(v, dict))]  # text_config
    for part in configs:
        model_type = str(part.get("model_type", "")).lower()
        layer_types = part.get("layer_types") or []
        recurrent = [
            t for t in layer_types if isinstance(t, str) and ("mamba" in t or "linear" in t)
        ]
        if model_type in STATE_SPACE_MODEL_TYPES or recurrent:
            kind = model_type or str(recurrent[0])
            raise CheckpointError(
                f"{path} is a state-space or hybrid model ({kind}); the model server decodes "
                "attention-only models (its cache holds keys and values per position). Serve "
                "it with vLLM through an openai serving target instead"
            )


@functools.cache
def _columns_cache() -> Any:
    """The transformers ``Cache`` class over one :class:`ForwardCall`'s rows of the engine's
    buffers: each new token's keys/values are written in their column, nothing is
    concatenated. Built on first use so importing this module does not import transformers."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class ColumnsLayer(CacheLayerMixin):
        is_sliding = False

        def __init__(self, forward: ForwardCall, layer: int) -> None:
            super().__init__()
            self.call, self.layer = forward, layer
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            return None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return write_columns(self.call, self.layer, key_states, value_states)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.call.width, 0

        def get_seq_length(self) -> int:
            return int(self.call.positions[0, 0])

        def get_max_length(self) -> int:
            return int(self.call.keys.shape[3])

    class Columns(Cache):
        def __init__(self, forward: ForwardCall, layers: int) -> None:
            super().__init__(layers=[ColumnsLayer(forward, i) for i in range(layers)])

    return Columns


CASCADE = "ratchet_cascade"  # the attention implementation's name in transformers' registry
SHARED_COLUMNS = "shared_columns"  # the model call's keyword its attention layers receive


@contextlib.contextmanager
def _attention(config: Any, cascade: bool) -> Iterator[None]:
    """The model's attention as the cascade for one call (transformers picks a layer's
    attention function by ``config._attn_implementation`` on every call); sdpa after it,
    so training's forward passes on the same model never see it."""
    if not cascade:
        yield
        return
    config._attn_implementation = _registered_cascade()
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@functools.cache
def _registered_cascade() -> str:
    """Register the cascade as an attention implementation of transformers, once: decode
    steps over shared columns cascade, every other call is transformers' own sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        shared = int(kwargs.pop(SHARED_COLUMNS, 0))
        plain = not any(kwargs.get(k) for k in ("softcap", "dropout", "position_bias", "s_aux"))
        if attention_mask is not None and plain and worth_cascading(query, shared):
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            out = cascade_attention(query, key, value, attention_mask, shared=shared, scale=scale)
            return out.transpose(1, 2), None  # (B, T, H, D), as sdpa_attention_forward's
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CASCADE, attention)
    return CASCADE


def _plain_dynamic_cache(model: Any) -> bool:
    """Whether every layer of ``model`` attends to every cached position.

    The engine's cache keeps every position of every layer and passes one attention mask
    for all layers, so models with sliding-window or other non-full attention layers are
    refused (they would attend past their window).
    """
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return not (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )


def _template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template uses its ``tools`` variable (many silently ignore it)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return isinstance(template, str) and "tools" in template
