"""What was sampled, in OpenAI's two ``logprobs`` shapes (chat's and the legacy completions').

The values are the raw model's log-probabilities (see :mod:`services.modelserver.openai_api`);
``-inf`` and NaN cannot travel in JSON, so they are clamped to :data:`LOGPROB_FLOOR` as vLLM
does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.inference.engine import GenerationResult, SampledToken

LOGPROB_FLOOR = -9999.0  # -inf cannot travel in JSON; vLLM clamps to the same floor


def sampled_tokens(result: GenerationResult) -> list[SampledToken]:
    """A finished row's sampled tokens (the end-of-turn token included) with their log-probs."""
    tops = result.top_logprobs or [()] * len(result.sampled_ids)
    return [
        SampledToken(token, logprob, top)
        for token, logprob, top in zip(result.sampled_ids, result.logprobs, tops, strict=True)
    ]


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if value == value else LOGPROB_FLOOR  # NaN too


def chat_logprobs(
    decode: Callable[[Sequence[int]], str], tokens: Sequence[SampledToken]
) -> list[dict[str, Any]]:
    """OpenAI's ``choices[].logprobs.content``: each token's text, log-prob, UTF-8 bytes and
    its ``top_logprobs`` alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return [
        {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
        for t in tokens
    ]


def text_logprobs(
    decode: Callable[[Sequence[int]], str], tokens: Sequence[SampledToken], offset: int
) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs``: parallel lists of token texts, their
    log-probs, the top alternatives (with the sampled token) and each text's offset."""
    texts = [decode([t.id]) for t in tokens]
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    tops = [{decode([i]): _logprob(lp) for i, lp in (*t.top, (t.id, t.logprob))} for t in tokens]
    return {
        "tokens": texts,
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": starts,
    }
