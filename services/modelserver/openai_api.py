"""The OpenAI wire format the model server speaks: request bodies, responses, errors.

Requests are validated strictly and every refusal is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status, so the official
``openai`` client raises its usual ``BadRequestError``/``NotFoundError`` with the field in
``param``. Fields of the OpenAI API that change nothing here (``user``, ``metadata``,
``store``, ``parallel_tool_calls``) are accepted; fields that would change the answer and
are not implemented (penalties, ``response_format``, ``logit_bias``, ``echo``, ``suffix``)
are refused rather than silently ignored.

What was sampled comes back on request, as vLLM returns it: ``logprobs`` (chat:
``logprobs: true`` and ``top_logprobs`` 0..20; completions: ``logprobs`` 0..20) are the
log-probabilities of the raw model output (temperature 1, before temperature and top-p
shape the distribution sampled from), which is vLLM's default ``--logprobs-mode
raw_logprobs``; ``return_token_ids: true`` (vLLM's extension) adds ``token_ids`` (every
sampled id, the end-of-turn token included) to each choice and ``prompt_token_ids`` where
vLLM puts them: on the response for chat, on each choice for completions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.chat.protocol import ChatMessage, validate_tools

# The header every completion carries: the checkpoint id of the version that answered (a
# serving target reads it to know what answered its probe).
VERSION_HEADER = "X-Ratchet-Model-Version"

MAX_MESSAGES = 512
MAX_CONTENT_CHARS = 256_000
MAX_N = 16
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs and OpenAI's top_logprobs bound


class OpenAIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """What chat and text completions share: sampling, stopping, streaming, extras."""

    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # vLLM's extension: the prompt's and choices' ids
    # Accepted, change nothing here.
    user: str | None = Field(default=None, max_length=256)
    # Refused unless neutral: they would change the answer and are not implemented.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop sequences must be 1 to 64 characters")
        return value

    def unsupported(self) -> OpenAIError | None:
        """The first field set to something this server does not implement."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return OpenAIError(400, f"{name} is not supported by this server", param=name)
        if self.logit_bias:
            return OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        return None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wants_token_ids(self) -> bool:
        return bool(self.return_token_ids)


class ChatCompletionRequest(_SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=32_768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32_768)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted, change nothing here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    # Refused unless neutral.
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> OpenAIError | None:
        """The first field set to something this server does not implement, or
        ``top_logprobs`` without ``logprobs: true`` (as OpenAI refuses it)."""
        refused = super().unsupported()
        if refused is not None:
            return refused
        if self.top_logprobs is not None and not self.logprobs:
            return OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.response_format not in (None, {"type": "text"}):
            return OpenAIError(
                400, "only response_format {'type': 'text'} is supported", param="response_format"
            )
        return None

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no log-probs; else how many alternatives to report with each token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unencodable(self) -> OpenAIError | None:
        """The first text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``,
        which JSON can carry and no tokenizer can encode)."""
        fields: list[tuple[str, Any]] = [
            ("model", self.model),
            ("messages", self.messages),
            ("tools", self.tools),
            ("tool_choice", self.tool_choice),
            ("stop", self.stop),
        ]
        for name, value in fields:
            where = _lone_surrogate(value, name)
            if where is not None:
                return OpenAIError(
                    400, f"{where} is not valid Unicode (a lone surrogate)", param=where
                )
        return None

    def parsed_messages(self) -> list[ChatMessage]:
        out = []
        for index, raw in enumerate(self.messages):
            where = f"messages[{index}]"
            try:
                message = ChatMessage.from_openai(raw, where=where)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param=_param_of(str(exc), where)) from exc
            if len(message.content or "") > MAX_CONTENT_CHARS:
                raise OpenAIError(
                    400,
                    f"{where}.content is longer than {MAX_CONTENT_CHARS} characters",
                    param=f"{where}.content",
                )
            out.append(message)
        return out

    def parsed_tools(self) -> list[dict[str, Any]]:
        if not self.tools:
            return []
        try:
            return validate_tools(self.tools)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=_param_of(str(exc), "tools")) from exc

    def forced_tool(self, tools: list[dict[str, Any]]) -> str | None:
        """The function named by ``tool_choice``, checked against ``tools``."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            if choice in ("required",) and not tools:
                raise OpenAIError(400, "tool_choice 'required' needs tools", param="tool_choice")
            return None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError(
                400,
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        if name not in {t["function"]["name"] for t in tools}:
            raise OpenAIError(400, f"tool_choice names unknown tool {name!r}", param="tool_choice")
        return name


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: one prompt, as text or as token ids (what a rollout sends,
    so the ids the model sees are exactly the ones the caller rendered)."""

    prompt: str | list[Any]
    max_tokens: int = Field(default=16, ge=1, le=32_768)  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Refused unless neutral.
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[Any]:
        if isinstance(value, str):
            if not value:
                raise ValueError("the prompt is empty")
            if len(value) > MAX_CONTENT_CHARS:
                raise ValueError(f"the prompt is longer than {MAX_CONTENT_CHARS} characters")
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of token ids")
        if not value:
            raise ValueError("the prompt is empty")
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            if min(value) < 0:
                raise ValueError("token ids must be >= 0")
            return value
        raise ValueError(
            "must be a string or a list of token ids (one prompt per request: a list of "
            "prompts is not supported)"
        )

    def unsupported(self) -> OpenAIError | None:
        refused = super().unsupported()
        if refused is not None:
            return refused
        if self.echo:
            return OpenAIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            return OpenAIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of not in (None, self.n):
            return OpenAIError(400, "best_of must equal n on this server", param="best_of")
        return None

    def unencodable(self) -> OpenAIError | None:
        for name, value in (("model", self.model), ("prompt", self.prompt), ("stop", self.stop)):
            where = _lone_surrogate(value, name)
            if where is not None:
                return OpenAIError(
                    400, f"{where} is not valid Unicode (a lone surrogate)", param=where
                )
        return None

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return self.logprobs


def _valid_unicode(value: str) -> str:
    """A name or path that can be encoded (served names end up in JSON, paths in syscalls)."""
    if _lone_surrogate(value, "") is not None:
        raise ValueError("is not valid Unicode (a lone surrogate)")
    return value


class LoadAdapterRequest(_Body):
    """vLLM's body; ``lora_path`` may also be a full-model checkpoint on this server."""

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False

    _unicode = field_validator("lora_name", "lora_path")(_valid_unicode)


class UnloadAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None

    _unicode = field_validator("lora_name")(_valid_unicode)


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The path of the first string in ``value`` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, where) or _lone_surrogate(item, f"{where}.{key}")
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def prompt_chars(messages: list[ChatMessage]) -> int:
    """Characters every chat template renders at least: the messages' contents (tools and
    calls may be rendered shorter, or not at all, so they do not count)."""
    return sum(len(message.content or "") for message in messages)


def _param_of(message: str, fallback: str) -> str:
    """The field path at the start of a ValueError from the chat protocol."""
    first = message.split(" ", 1)[0]
    return first if first.startswith(fallback.split("[")[0]) else fallback


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """A pydantic validation failure as OpenAI's error, naming the first bad field."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif param:
        message = f"{param}: {message}"
    return OpenAIError(400, message, param=param)
