"""Tiny random-init ``hf`` checkpoints built in the test: a Llama, its tokenizer with a chat
template that renders tools, and LoRA adapters on it. Nothing is fetched from a hub."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.serving.base import CheckpointRef
from services.training.checkpoint import checkpoint_id_from_hashes, sha256_file

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_manifest(path: Path, *, base: CheckpointRef | None = None) -> CheckpointRef:
    """A ``ratchet.checkpoint/v1`` manifest listing every file with its sha256."""
    hashes = {
        p.name: sha256_file(p) for p in sorted(path.iterdir()) if p.name != "manifest.json"
    }
    checkpoint_id = checkpoint_id_from_hashes(hashes)
    manifest = {
        "schema": "ratchet.checkpoint/v1",
        "checkpoint_id": checkpoint_id,
        "format": "hf-lora" if base is not None else "hf",
        "parent": base.id if base is not None else None,
        "files": {n: {"sha256": h, "size": (path / n).stat().st_size} for n, h in hashes.items()},
        "metadata": {"base_checkpoint_id": base.id} if base is not None else {},
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return CheckpointRef(id=checkpoint_id, uri=path.resolve().as_uri())


def write_tiny_llama(path: Path, seed: int = 0) -> CheckpointRef:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    return write_manifest(path)


def write_lora_adapter(base: CheckpointRef, path: Path, seed: int) -> CheckpointRef:
    """A LoRA adapter on ``base`` with random (non-zero) weights, so it changes the answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base.uri.removeprefix("file://"))
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(path, safe_serialization=True)
    return write_manifest(path, base=base)
