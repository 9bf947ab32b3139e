"""Tiny random-init ``hf`` checkpoints built in the test: a Llama, its tokenizer with a chat
template that renders tools, and LoRA adapters on it. Nothing is fetched from a hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.serving.base import CheckpointRef
from services.training.checkpoint import Manifest, read_manifest
from services.training.hf.checkpoint import save_hf_checkpoint, save_lora_adapter
from tests.services.training.hf_support import chatml_tokenizer, tiny_llama_config

# ChatML, with the tools rendered by name only: short prompts keep the test's training cheap.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return chatml_tokenizer(core, pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def _ref(manifest: Manifest, path: Path) -> CheckpointRef:
    return CheckpointRef(id=manifest.checkpoint_id, uri=path.resolve().as_uri())


def write_tiny_llama(path: Path, seed: int = 0) -> CheckpointRef:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = tiny_llama_config(tokenizer, max_position_embeddings=512)
    return _ref(save_hf_checkpoint(LlamaForCausalLM(config), tokenizer, path), path)


def write_lora_adapter(base: CheckpointRef, path: Path, seed: int) -> CheckpointRef:
    """A LoRA adapter on ``base`` with random (non-zero) weights, so it changes the answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base_dir = Path(base.uri.removeprefix("file://"))
    model = LlamaForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    return _ref(save_lora_adapter(peft_model, path, base=read_manifest(base_dir)), path)


def write_replying_llama(path: Path, reply: str) -> CheckpointRef:
    """A tiny Llama whose greedy answer to every conversation is ``reply``, then end of turn.

    Built, not trained (training is slow on a shared CPU): the reply is one added token, the
    attention and MLP outputs are zeroed so the residual stream is the current token's
    embedding, and the output head maps the generation prompt's last token (``\n``) to the
    reply token and the reply token to ``<|im_end|>``. The template, the decode loop and the
    tool-call parser all run for real on its output.
    """
    from transformers import LlamaForCausalLM

    scratch = path.with_name(f"{path.name}-random")
    write_tiny_llama(scratch)
    tokenizer: Any = _tokenizer()
    tokenizer.add_tokens([reply])
    model = LlamaForCausalLM.from_pretrained(scratch)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    reply_id = tokenizer.convert_tokens_to_ids(reply)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight  # (V, C)
        head = model.lm_head.weight  # (V, C)
        head.normal_(0.0, 0.01)
        unit = embeddings / embeddings.norm(dim=-1, keepdim=True)  # (V, C)
        head[reply_id] = 50.0 * unit[newline]
        head[tokenizer.eos_token_id] = 50.0 * unit[reply_id]
    return _ref(save_hf_checkpoint(model, tokenizer, path), path)


def train_to_answer(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Overfit ``model`` until each prompt's greedy continuation is its completion; the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(400):
        loss = torch.tensor(0.0)
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])  # (1, T)
            logits = model(ids[:, :-1])  # (1, T-1, V)
            start = len(prompt) - 1
            loss = loss + torch.nn.functional.cross_entropy(logits[0, start:], ids[0, start + 1 :])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if float(loss.detach()) < 0.02 * len(pairs):
            break
    model.eval()
    return float(loss.detach())
