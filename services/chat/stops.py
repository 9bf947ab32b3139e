"""Where an assistant's turn ends: the one stop rule of serving and evaluation.

A reply ends at the tokenizer's end-of-sequence token, at any the model's generation config
names, at ChatML's ``<|im_end|>`` when the vocabulary has it, and at the token the chat
template writes right after an assistant's content (``<|eot_id|>``, ``<end_of_turn>``...).
The last two matter for base models: a Qwen2-base or GPT-2-style tokenizer with a ChatML
template names ``<|endoftext|>`` as its eos, and a reply that only stops there runs on to
``max_tokens`` past the end of its turn. The model server (:mod:`services.inference.hf`)
and evaluation (:class:`services.training.hf.model.HFModel`) both stop by this rule, so what
is served is what was measured.
"""

from __future__ import annotations

from typing import Any

CHATML_END = "<|im_end|>"
_MARK = "RATCHET-END-OF-TURN-PROBE"


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list | tuple):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` if it is one token of the vocabulary (not the unknown token)."""
    try:
        found = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(found, int) or found == getattr(tokenizer, "unk_token_id", None):
        return None
    return found


def template_end_of_turn(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant's content."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that refuses this conversation names no end token
        return None
    if not isinstance(text, str) or _MARK not in text:
        return None
    after = text.split(_MARK, 1)[1].lstrip()
    specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials += [str(getattr(t, "content", t)) for t in added.values()]
    for token in sorted(set(specials), key=len, reverse=True):
        if token and after.startswith(token):
            return _token_id(tokenizer, token)
    return None


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """Every token id that ends an assistant turn (see the module docstring)."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _ids(getattr(generation_config, "eos_token_id", None))
    for found in (_token_id(tokenizer, CHATML_END), template_end_of_turn(tokenizer)):
        if found is not None:
            ids.add(found)
    return frozenset(ids)
