"""A tiny random-init Llama with a ChatML tokenizer, built offline inside the tests.

The tokenizer is a byte-level BPE trained in milliseconds on toolcalc-like text (so chat
prompts tokenize into few tokens), wrapped as a transformers fast tokenizer with a ChatML
chat template that, like SmolLM2's, does not render ``tools=``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.training.checkpoint import Manifest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer() -> object:
    from tokenizers import ByteLevelBPETokenizer

    from services.environments.toolcalc import ToolcalcEnvironment
    from services.training.hf.model import HFModel  # noqa: F401 - same import path as prod

    env = ToolcalcEnvironment()
    corpus = []
    for version in ("v1", "v2", "v3"):
        for task in env.generate_tasks(24, seed=5, api_version=version):
            for messages, text in env.chat_demonstration(task):
                corpus.extend(m.content or "" for m in messages)
                corpus.append(text)
    from services.chat.render import tools_system_prompt

    corpus.append(tools_system_prompt(env.chat_start(task, max_turns=1).tools))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus,
        vocab_size=700,
        min_frequency=2,
        special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
    )
    return chatml_tokenizer(bpe, pad_token="<pad>", chat_template=CHATML)


def chatml_tokenizer(core: Any, *, pad_token: str, chat_template: str) -> Any:
    """``core`` (a ``tokenizers`` tokenizer) as a transformers fast tokenizer with ChatML's
    turn markers as its special tokens and ``chat_template`` as its template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token=pad_token,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_llama_config(tokenizer: Any, *, max_position_embeddings: int) -> Any:
    """A 2-layer Llama sized to ``tokenizer``: small enough to train in a test on a CPU."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_llama(out_dir: Path, *, seed: int = 0) -> Manifest:
    """Save a 2-layer random Llama + the tokenizer as an hf checkpoint at ``out_dir``."""
    import torch
    from transformers import LlamaForCausalLM

    from services.training.hf.checkpoint import save_hf_checkpoint

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=2048))
    return save_hf_checkpoint(model, tokenizer, out_dir, metadata={"model": "tiny-llama"})
