"""``ratchet.trace/v1``: the native trace document, its batch form, and the parser of bodies.

One episode as the agent runtime saw it: the tools it was offered, every message (with tool
calls and, when the serving layer has them, token ids and logprobs), the outcome, and free
metadata. Other parts of Ratchet read ``trace_bodies.body`` in exactly this shape, so the models
here are the contract: fields may be added (optional), never renamed or removed.

Parsing is strict where a mistake would silently lose data (unknown keys are errors, not
ignored) and bounded where input could hurt the server (nesting depth of free-form objects,
string lengths of indexed columns, NUL characters that Postgres cannot store).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import operator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from services.ingest.errors import IngestError
from services.ingest.warnings import Screen, TraceWarning

TRACE_SCHEMA = "ratchet.trace/v1"
SCHEMA_ID = "https://ratchet.dev/schemas/ratchet.trace.v1.json"
# Free-form objects (metadata, tool parameters, call arguments) may nest this deep.
MAX_FREE_DEPTH = 32

ShortText = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Kind = Annotated[str, StringConstraints(min_length=1, max_length=128)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def depth_exceeded(value: Any, limit: int = MAX_FREE_DEPTH) -> bool:
    """Whether a decoded JSON value nests objects/arrays deeper than ``limit``.

    A bare object or array is one level. Recursive, at most ``limit + 1`` frames deep, and
    leaves cost only a type check: this runs on every free-form object of every trace.
    """
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return False
    if limit < 1:
        return True
    for child in children:
        if isinstance(child, dict | list) and depth_exceeded(child, limit - 1):
            return True
    return False


def _bounded_depth(value: Any) -> Any:
    if depth_exceeded(value):
        raise ValueError(f"nested deeper than {MAX_FREE_DEPTH} levels")
    return value


def _object_or_string(value: Any) -> Any:
    """A JSON object (nested at most MAX_FREE_DEPTH levels) or a string; one callback."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object or a string")
    if depth_exceeded(value):
        raise ValueError(f"nested deeper than {MAX_FREE_DEPTH} levels")
    return value


# ``value is None`` without a Python frame: the serializer calls it for five keys of every
# message (~0.9 µs per trace less than a def, measured in-process).
_is_none = functools.partial(operator.is_, None)


FreeObject = Annotated[dict[str, Any], BeforeValidator(_bounded_depth)]
Arguments = Annotated[dict[str, Any] | str, BeforeValidator(_object_or_string)]


class _Strict(BaseModel):
    """Unknown keys are errors (a typo must not drop data); no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ToolSpec(_Strict):
    """A tool as the agent saw it: name, description, JSON Schema of its parameters."""

    name: ShortText
    description: str | None = None
    parameters: FreeObject = Field(default_factory=dict)


class ToolCall(_Strict):
    """One call the model asked for; arguments as an object, or the raw string it produced."""

    id: ShortText
    name: ShortText
    arguments: Arguments = Field(default_factory=dict)


class Message(_Strict):
    """One message of the episode, OpenAI-chat shaped."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    # Optional keys: stored only when present, as the contract writes them (``key?``).
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)
    tool_call_id: ShortText | None = Field(default=None, exclude_if=_is_none)
    name: ShortText | None = Field(default=None, exclude_if=_is_none)
    token_ids: list[TokenId] | None = Field(default=None, exclude_if=_is_none)
    logprobs: list[float] | None = Field(default=None, exclude_if=_is_none)

    @model_validator(mode="after")
    def _consistent(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if (
            self.token_ids is not None
            and self.logprobs is not None
            and len(self.token_ids) != len(self.logprobs)
        ):
            raise ValueError("logprobs must have one entry per token id")
        return self


class OutcomeError(_Strict):
    """Why the episode failed, as the runtime classified it."""

    kind: Kind
    message: str = ""


class Outcome(_Strict):
    """What production knew about the episode's result; any part may be unknown (null)."""

    success: bool | None = None
    score: float | None = None
    error: OutcomeError | None = None


class TraceV1(_Strict):
    """One production episode, ``ratchet.trace/v1``."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        title="Trace",
        json_schema_extra={"description": "One production episode, ratchet.trace/v1."},
    )

    schema_: Literal["ratchet.trace/v1"] = Field(alias="schema")
    external_id: ShortText
    model_version: ShortText | None = None
    # The ids of the completions the model server answered in this episode, as its responses
    # gave them: a Ratchet model server signs them for the version that answered, so the
    # canary counts the trace by the server's word (services/modelserver/attestation.py).
    response_ids: list[ShortText] = Field(default_factory=list, max_length=1024)
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    tools: list[ToolSpec] = Field(default_factory=list)
    messages: list[Message] = Field(min_length=1)
    outcome: Outcome = Field(default_factory=Outcome)
    reference_answer: str | None = None
    metadata: FreeObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _timestamps(self) -> TraceV1:
        """A timestamp without an offset is taken as UTC; ``ended_at`` may not precede
        ``started_at``. (One model-level callback, not one per field: this runs per trace.)"""
        started, ended = self.started_at, self.ended_at
        if started is not None and started.tzinfo is None:
            self.started_at = started = started.replace(tzinfo=dt.UTC)
        if ended is not None and ended.tzinfo is None:
            self.ended_at = ended = ended.replace(tzinfo=dt.UTC)
        if started and ended and ended < started:
            raise ValueError("ended_at is before started_at")
        return self


class TraceBatch(_Strict):
    """Several traces in one request; each one is accepted, a duplicate, or rejected alone."""

    model_config = ConfigDict(extra="forbid", title="TraceBatch")

    traces: list[TraceV1] = Field(min_length=1)


TraceRequest = TraceV1 | TraceBatch
_REQUEST_ADAPTER: TypeAdapter[TraceRequest] = TypeAdapter(TraceRequest)


def json_schema() -> dict[str, Any]:
    """The published JSON Schema (schemas/ratchet.trace.v1.json): one trace, or a batch."""
    schema = _REQUEST_ADAPTER.json_schema(by_alias=True)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": TRACE_SCHEMA,
        "description": (
            'A production episode reported to Ratchet (one trace), or {"traces": [...]} '
            "to send several in one request."
        ),
        **schema,
    }


def inlined_schema() -> dict[str, Any]:
    """The request schema with every ``$ref`` replaced by its definition (for the OpenAPI)."""
    schema = _REQUEST_ADAPTER.json_schema(by_alias=True)
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(definitions[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


# Parsing ------------------------------------------------------------------------------------


# Not frozen: a frozen dataclass's __init__ costs ~3x (object.__setattr__ per field), and
# one of these is built per trace on the ingest hot path. Treat instances as read-only.
@dataclass(slots=True)
class StoredTrace:
    """A validated trace as the writer stores it: the body JSON plus the indexed columns."""

    external_id: str
    body_json: str
    size_bytes: int
    model_version: str | None
    success: bool | None
    score: float | None
    error_kind: str | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    # What the loop's curation will make of it that its poster should know (.warnings).
    warnings: tuple[TraceWarning, ...] = ()


@dataclass(frozen=True)
class Rejection:
    """One item that could not be accepted, with the reason and the paths at fault."""

    index: int
    external_id: str | None
    reason: str
    fields: list[dict[str, str]] = field(default_factory=list)


@dataclass
class ParsedBody:
    """What a request body held: valid traces by position, and the rejected items."""

    batch: bool
    total: int
    traces: list[tuple[int, StoredTrace]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


def field_errors(
    error: ValidationError, prefix: tuple[str | int, ...] = ()
) -> list[dict[str, str]]:
    """Pydantic errors as ``{"path": "traces.0.outcome.success", "message": ...}`` items."""
    return [
        {
            "path": ".".join(str(part) for part in (*prefix, *item["loc"])) or "(root)",
            "message": item["msg"],
        }
        for item in error.errors(include_url=False, include_input=False)
    ]


def _nul_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[str]:
    """Paths of strings (and object keys) holding a NUL character."""
    found: list[str] = []
    if isinstance(value, str):
        if "\x00" in value:
            found.append(".".join(str(p) for p in path) or "(root)")
    elif isinstance(value, dict):
        for key, item in value.items():
            if "\x00" in key:
                found.append(".".join(str(p) for p in (*path, key)))
            found.extend(_nul_paths(item, (*path, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(_nul_paths(item, (*path, index)))
    return found


def _has_escaped_nul(text: str) -> bool:
    r"""Whether serialized JSON holds ``\u0000`` as an escape (not as an escaped backslash)."""
    start = text.find("\\u0000")
    while start >= 0:
        backslashes = 0
        while start - backslashes - 1 >= 0 and text[start - backslashes - 1] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return True
        start = text.find("\\u0000", start + 1)
    return False


def to_stored(
    trace: TraceV1, prefix: tuple[str | int, ...] = (), warnings: tuple[TraceWarning, ...] = ()
) -> StoredTrace:
    """Serialize a validated trace for storage; refuse what Postgres cannot hold (NUL)."""
    # Bytes straight from the Rust serializer (model_dump_json would decode them to str, and
    # the size would need an encode back).
    body_bytes = trace.__pydantic_serializer__.to_json(trace, by_alias=True)
    body_json = body_bytes.decode("utf-8")
    if _has_escaped_nul(body_json):
        paths = _nul_paths(trace.model_dump(by_alias=True, mode="json"))
        raise IngestError(
            422,
            "invalid_trace",
            "strings may not contain NUL (\\u0000) characters",
            [
                {"path": ".".join(str(p) for p in (*prefix, path)), "message": "contains NUL"}
                for path in paths
            ],
        )
    error = trace.outcome.error
    return StoredTrace(
        external_id=trace.external_id,
        body_json=body_json,
        size_bytes=len(body_bytes),
        model_version=trace.model_version,
        success=trace.outcome.success,
        score=trace.outcome.score,
        error_kind=error.kind if error is not None else None,
        started_at=trace.started_at,
        ended_at=trace.ended_at,
        warnings=warnings,
    )


def validate_trace(
    item: Any, prefix: tuple[str | int, ...] = (), screen: Screen | None = None
) -> StoredTrace:
    """Validate one decoded trace; raise :class:`IngestError` (422) listing each bad field.
    ``screen``: the loop's warnings (services.ingest.warnings), kept on the stored trace."""
    try:
        # The validator itself: model_validate's wrapper costs ~0.3 µs per trace.
        trace: TraceV1 = TraceV1.__pydantic_validator__.validate_python(item)
    except ValidationError as exc:
        raise IngestError(
            422,
            "invalid_trace",
            "the trace does not match ratchet.trace/v1",
            field_errors(exc, prefix),
        ) from None
    return to_stored(trace, prefix, tuple(screen(trace)) if screen is not None else ())


def decode_json(body: bytes) -> Any:
    """Decode a JSON body; a 400 says where it broke (line and column) or that it is not UTF-8."""
    if not body.strip():
        raise IngestError(
            400, "empty_body", "the request has no body; send a ratchet.trace/v1 JSON document"
        )
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as utf8:
            raise IngestError(
                400, "invalid_encoding", f"the body is not valid UTF-8 (byte {utf8.start})"
            ) from None
        detail = str(exc)
        if "recursion limit" in detail:
            detail = f"nested too deeply ({detail})"
        raise IngestError(400, "invalid_json", f"the body is not valid JSON: {detail}") from None


def _item_external_id(item: Any) -> str | None:
    value = item.get("external_id") if isinstance(item, dict) else None
    return value if isinstance(value, str) else None


def parse_native(body: bytes, *, max_batch: int, screen: Screen | None = None) -> ParsedBody:
    """Parse a webhook body: one trace, or ``{"traces": [...]}`` validated item by item.

    A single invalid trace is a 422; in a batch, invalid items are rejected one by one and
    the valid ones go on, unless no item is valid (then the whole request is a 422). Each
    valid trace is run through ``screen`` (the loop's warnings), if given.
    """
    data = decode_json(body)
    if not isinstance(data, dict):
        raise IngestError(
            422,
            "invalid_request",
            'the body must be a JSON object: one trace, or {"traces": [...]}',
            [{"path": "(root)", "message": f"got a JSON {type(data).__name__}"}],
        )
    if "traces" in data and "schema" not in data:
        return _parse_batch(data, max_batch=max_batch, screen=screen)
    parsed = ParsedBody(batch=False, total=1)
    parsed.traces.append((0, validate_trace(data, screen=screen)))
    return parsed


def _parse_batch(data: dict[str, Any], *, max_batch: int, screen: Screen | None) -> ParsedBody:
    extra = sorted(key for key in data if key != "traces")
    items = data["traces"]
    if extra or not isinstance(items, list) or not items:
        fields = [{"path": key, "message": "unknown field"} for key in extra]
        if not isinstance(items, list):
            fields.append({"path": "traces", "message": "must be an array of traces"})
        elif not items:
            fields.append({"path": "traces", "message": "must hold at least one trace"})
        raise IngestError(422, "invalid_request", "the batch envelope is malformed", fields)
    if len(items) > max_batch:
        raise IngestError(
            413,
            "batch_too_large",
            f"the batch has {len(items)} traces; at most {max_batch} are accepted per request",
        )
    parsed = ParsedBody(batch=True, total=len(items))
    for index, item in enumerate(items):
        try:
            parsed.traces.append((index, validate_trace(item, ("traces", index), screen)))
        except IngestError as exc:
            parsed.rejected.append(
                Rejection(index, _item_external_id(item), exc.message, exc.fields)
            )
    if not parsed.traces:
        fields = [f for rejection in parsed.rejected for f in rejection.fields]
        raise IngestError(422, "invalid_trace", "no trace in the batch is valid", fields)
    return parsed


def dumps_schema() -> str:
    """The JSON Schema file's exact text (sorted keys, two-space indent, trailing newline)."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
