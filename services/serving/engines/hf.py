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

import inspect
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from services.chat.protocol import ChatMessage
from services.chat.render import messages_with_tools_prompt
from services.chat.toolcalls import parse_assistant_output
from services.serving.engine import BatchForward, EngineError
from services.training.checkpoint import CheckpointError, read_manifest, sha256_file
from services.training.device import resolve_device

FAMILY = "hf"
BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def is_hf_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def is_hf_model(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data


def verify_hf_dir(path: Path) -> tuple[str, str | None]:
    """Check a full model or adapter directory against its manifest: (checkpoint id, base id).

    Every file the manifest lists must hash to its sha256, and pickle weights are refused:
    a served model runs no code from its checkpoint.
    """
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path} holds pickle weights ({', '.join(pickles)}); only safetensors are served"
        )
    manifest = read_manifest(path)
    for name, entry in sorted(manifest.files.items()):
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not file.is_file():
            raise CheckpointError(f"checkpoint file {name} is missing from {path}")
        if file.is_symlink():
            raise CheckpointError(f"checkpoint file {name} in {path} is a symlink")
        if sha256_file(file) != entry.sha256:
            raise CheckpointError(
                f"checkpoint file {name} in {path} does not match its manifest (tampered or "
                "corrupt)"
            )
    base = manifest.metadata.get("base_checkpoint_id") or manifest.parent
    return manifest.checkpoint_id, base if isinstance(base, str) and is_hf_adapter(path) else None


class HFEngine:
    """A transformers causal LM (the base) and the LoRA adapters resident on it."""

    family = FAMILY

    def __init__(self, model: Any, tokenizer: Any, *, path: Path, version: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.path = str(path)
        self.version = version
        self.device = next(model.parameters()).device
        self._adapters: dict[str, str] = {}  # adapter name -> checkpoint id
        self._peft: Any = None
        self._lock = threading.Lock()  # adapter loads vs. batch forward passes
        eos = tokenizer.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        generation = getattr(model, "generation_config", None)
        extra = getattr(generation, "eos_token_id", None)
        ids.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
        self.eos_ids = frozenset(int(i) for i in ids)
        self._template_takes_tools = _template_renders_tools(tokenizer)
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns).
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    @classmethod
    def load(cls, path: Path, *, device: str = "auto") -> HFEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        version, _ = verify_hf_dir(path)
        target = resolve_device(device)
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=dtype, use_safetensors=True
            )
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot load the model in {path}: {exc}") from exc
        if tokenizer.chat_template is None:
            raise CheckpointError(f"{path} has no chat template in its tokenizer files")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = model.to(target)  # type: ignore[arg-type]  # transformers' overloads
        model.eval()
        return cls(model, tokenizer, path=path, version=version)

    # Adapters ----------------------------------------------------------------------------

    def adapters(self) -> frozenset[str]:
        return frozenset(self._adapters)

    def adapter_version(self, name: str) -> str | None:
        return self._adapters.get(name)

    def load_adapter(self, name: str, path: Path) -> str:
        """Load the LoRA adapter at ``path`` as ``name`` (replacing one of that name); its id."""
        from peft import PeftModel

        version, base = verify_hf_dir(path)
        if base is not None and base != self.version:
            raise CheckpointError(
                f"adapter {path} was trained on {base[:12]}, this server's base model is "
                f"{self.version[:12]}"
            )
        with self._lock:
            try:
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(
                        self.model, str(path), adapter_name=name, is_trainable=False
                    )
                else:
                    if name in self._adapters:
                        self._peft.delete_adapter(name)
                    self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"cannot load the adapter in {path}: {exc}") from exc
            self._peft.eval()
            self._adapters[name] = version
        return version

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                return
            if self._peft is not None:
                self._peft.delete_adapter(name)
            del self._adapters[name]

    # Engine ------------------------------------------------------------------------------

    def context_length(self) -> int:
        config = self.model.config
        return int(getattr(config, "max_position_embeddings", 0) or 2048)

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

    def decode_text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def parse_reply(self, text: str, tools: Sequence[dict[str, Any]]) -> ChatMessage:
        names = [tool.get("function", tool).get("name") for tool in tools]
        return parse_assistant_output(text, tool_names=[n for n in names if isinstance(n, str)])

    def forward(self, adapters: Sequence[str | None]) -> BatchForward:
        from transformers import DynamicCache

        missing = sorted({a for a in adapters if a is not None and a not in self._adapters})
        if missing:
            raise EngineError(f"adapter {missing[0]!r} is not loaded")
        # Once peft has wrapped the base, its layers carry LoRA: base rows must say "__base__".
        use_adapters = self._peft is not None
        model = self._peft if use_adapters else self.model
        names = [a or BASE_ADAPTER for a in adapters]
        cache_key = self._cache_kwarg
        state: dict[str, Any] = {}

        def call(**inputs: Any) -> torch.Tensor:
            if use_adapters:
                inputs["adapter_names"] = names
            with self._lock:
                out = model(**inputs, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]  # (B, V)

        def prefill(ids: torch.Tensor, valid: torch.Tensor, new_tokens: int) -> torch.Tensor:
            mask = valid.long()  # (B, P)
            pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
            cache = DynamicCache()
            state.update(mask=mask, pos=pos[:, -1], cache=cache)
            return call(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_key: cache})

        def step(tokens: torch.Tensor) -> torch.Tensor:
            ones = torch.ones_like(state["mask"][:, :1])
            state["mask"] = torch.cat([state["mask"], ones], dim=1)  # (B, S)
            state["pos"] = state["pos"] + 1  # (B,)
            return call(
                input_ids=tokens[:, None],
                attention_mask=state["mask"],
                position_ids=state["pos"][:, None],
                **{cache_key: state["cache"]},
            )

        return BatchForward(prefill=prefill, step=step, max_positions=self.context_length())


def _template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template uses its ``tools`` variable (many silently ignore it)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return isinstance(template, str) and "tools" in template
