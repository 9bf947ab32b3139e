"""One ``/v1/completions`` request: a raw prompt (text or token ids), OpenAI's legacy shape.

What a remote rollout sends (:mod:`services.inference.remote`): the prompt as the ids the
trainer rendered, so the server samples from exactly those tokens. Everything else (rows,
streaming, stopping) is the chat completion's (:mod:`services.modelserver.completion`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from services.inference.engine import GenerationResult, SampledToken, cut_at_stop
from services.modelserver.completion import Completion
from services.modelserver.logprobs import text_logprobs
from services.modelserver.openai_api import CompletionRequest, OpenAIError
from services.modelserver.registry import ServedModel
from services.modelserver.scheduler import BatchScheduler


class TextCompletion(Completion):
    """One ``/v1/completions`` request: a raw prompt (text or ids), OpenAI's legacy shape."""

    ID_PREFIX = "cmpl"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"  # OpenAI's legacy stream chunks say so too
    PROMPT_IDS_ON_CHOICE = True

    @classmethod
    async def create_text(
        cls, body: CompletionRequest, served: ServedModel, scheduler: BatchScheduler
    ) -> TextCompletion:
        """The request with its prompt as ids: text is encoded off the event loop (refused
        first when longer than the context could hold), ids are checked against the vocab."""
        engine = served.engine
        context = engine.context_length()
        if isinstance(body.prompt, str):
            if len(body.prompt) > context * engine.max_chars_per_token:
                raise OpenAIError(
                    400,
                    f"the prompt holds {len(body.prompt)} characters, more than fit in this "
                    f"model's context; this model's context is {context} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
            prompt = await run_in_threadpool(engine.encode_text, body.prompt)
            if not prompt:
                raise OpenAIError(400, "the prompt encodes to no tokens", param="prompt")
        else:
            prompt = [int(i) for i in body.prompt]
            vocab = engine.vocab_size()
            bad = next((i for i, token in enumerate(prompt) if token >= vocab), None)
            if bad is not None:
                raise OpenAIError(
                    400,
                    f"prompt[{bad}] is token id {prompt[bad]}; this model's ids are 0 to "
                    f"{vocab - 1}",
                    param=f"prompt[{bad}]",
                )
        return cls(body, served, prompt, [], None, scheduler)

    @staticmethod
    def _prompt_param() -> str:
        return "prompt"

    def _text(self, result: GenerationResult) -> str:
        return cut_at_stop(self.engine.decode_text(result.token_ids), self.stops)

    def _choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        return {
            "index": index,
            "text": self._text(result),
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }

    def _logprobs(self, tokens: Sequence[SampledToken], offset: int) -> dict[str, Any]:
        return text_logprobs(self.engine.decode_text, tokens, offset)

    @staticmethod
    def _chunk_choice(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "text": delta.get("text", ""),
            "finish_reason": finish,
            "logprobs": None,
        }

    @staticmethod
    def _text_delta(text: str) -> dict[str, Any]:
        return {"text": text}

    def _opening(self, index: int) -> str | None:
        return None

    def _closing(
        self, index: int, result: GenerationResult, sent: int, tokens: list[SampledToken], at: int
    ) -> list[str]:
        rest = self._text(result)[sent:]
        chunks = []
        if rest or tokens:
            chunks.append(self._chunk(index, self._text_delta(rest), None, tokens, at))
        chunks.append(self._chunk(index, {}, result.finish_reason))
        return chunks
