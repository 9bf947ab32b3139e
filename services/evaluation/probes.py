"""The probe set: what the candidate answered to a few greedy prompts, kept with its evaluation.

Proof of delivery (``services.serving.delivery``) sends these prompts to the serving endpoint
after every deploy and rollback and compares the answer with what the checkpoint produced
here. So a probe is recorded exactly as a model server would see and answer it:

- ``messages`` and ``tools``: the OpenAI chat request (the first turn of the task, as the
  environment presents it to an agent), rendered with the engine's own template
  (``Engine.render``, the function ``ratchet serve`` renders requests with) from the messages
  parsed back from that wire form, so the prompt ids are what a server computes;
- ``token_ids``: the completion's tokens decoded greedily (temperature 0) through the same
  inference engine the server decodes with; ``stop_id`` the stop token that ended it, if one
  did; ``logprobs``: one log-probability per sampled id (the stop token's last), under the
  model's raw logits (temperature 1: what ``logprobs: true`` returns);
- ``text``: the completion's text, for servers that return neither token ids nor log-probs;
- ``margins`` and ``runners_up``: per sampled id, how many nats the greedy choice led the
  runner-up by, and the runner-up's id. Where the margin is this small, a server computing
  in another precision may pick the runner-up, and proof of delivery accepts it there
  (``services.serving.delivery``). Absent (None) in probe sets written before them.

The eval job writes ``probes.json`` (``ratchet.probes/v1``) beside ``results.jsonl`` and
lists it in ``metrics.json`` (``"probes": {"file", "sha256", "count"}``); the worker reads it
only through that listing (:func:`read_listed_probes`), as it reads every job output: a
regular file, size-bounded, its hash checked. Standard library only: the job writes it,
the worker (and the api, through the workflows it imports) reads it; the capture, which
needs torch and the inference engine, is ``services.evaluation.probe_capture``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.chat.protocol import ChatMessage, validate_tools
from services.chat.text import load_job_json, valid_json
from services.evaluation.results import read_job_output

PROBES_FILE = "probes.json"
PROBES_SCHEMA = "ratchet.probes/v1"
MAX_PROBES = 64
MAX_PROBE_FILE_BYTES = 4 << 20


class ProbeFileError(ValueError):
    """A probe set that is listed but cannot be read or is malformed; says which field."""


@dataclass(frozen=True)
class Probe:
    """One greedy prompt and what the checkpoint answered to it."""

    task_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_tokens: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    stop_id: int | None
    logprobs: list[float]
    text: str
    margins: list[float] | None = None
    runners_up: list[int] | None = None


@dataclass(frozen=True)
class ProbeSet:
    """The probes of one checkpoint, as its evaluation recorded them."""

    checkpoint_id: str
    probes: list[Probe]


def write_probes(output_dir: Path, checkpoint_id: str, probes: Sequence[Probe]) -> dict[str, Any]:
    """Write ``probes.json``; its listing for ``metrics.json`` (file, sha256, count)."""
    body = {
        "schema": PROBES_SCHEMA,
        "checkpoint_id": checkpoint_id,
        "probes": [valid_json(asdict(p)) for p in probes],  # model text, made storable
    }
    data = json.dumps(body, sort_keys=True).encode("utf-8")
    path = output_dir / PROBES_FILE
    tmp = path.with_name(f".{PROBES_FILE}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return {"file": PROBES_FILE, "sha256": hashlib.sha256(data).hexdigest(), "count": len(probes)}


def read_listed_probes(output_dir: Path, metrics: Mapping[str, Any]) -> ProbeSet | None:
    """The probe set a run's ``metrics.json`` lists, or None when it lists none (a run from
    before probes). A file the listing does not name is never read; a listed one that is
    missing, not a regular file, of another hash or malformed is a :class:`ProbeFileError`."""
    listing = metrics.get("probes")
    if listing is None:
        return None
    if not isinstance(listing, Mapping):
        raise ProbeFileError("metrics.probes must be an object (file, sha256, count)")
    name, digest = listing.get("file"), listing.get("sha256")
    if name != PROBES_FILE:
        raise ProbeFileError(f"metrics.probes.file must be {PROBES_FILE!r}, got {name!r}")
    if not isinstance(digest, str):
        raise ProbeFileError("metrics.probes.sha256 must be a string")
    path = output_dir / PROBES_FILE
    try:
        text = read_job_output(path, limit=MAX_PROBE_FILE_BYTES)
    except (OSError, UnicodeDecodeError) as exc:
        raise ProbeFileError(f"cannot read the probe set {path}: {exc}") from None
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != digest:
        raise ProbeFileError(f"the probe set {path} does not match the sha256 its run listed")
    try:
        data = load_job_json(text)
    except (ValueError, RecursionError) as exc:
        raise ProbeFileError(f"the probe set {path} is not JSON: {exc}") from None
    return parse_probe_set(data)


def parse_probe_set(data: Any) -> ProbeSet:
    """A ``ratchet.probes/v1`` document as a :class:`ProbeSet`; ProbeFileError names the field."""
    if not isinstance(data, dict):
        raise ProbeFileError("the probe set must be a JSON object")
    if data.get("schema") != PROBES_SCHEMA:
        raise ProbeFileError(f"probes.schema must be {PROBES_SCHEMA!r}, got {data.get('schema')!r}")
    checkpoint_id = data.get("checkpoint_id")
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise ProbeFileError("probes.checkpoint_id must be a non-empty string")
    raw = data.get("probes")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PROBES:
        raise ProbeFileError(f"probes.probes must be a list of 1 to {MAX_PROBES} probes")
    return ProbeSet(
        checkpoint_id, [_probe(item, f"probes.probes[{i}]") for i, item in enumerate(raw)]
    )


def _probe(item: Any, where: str) -> Probe:
    if not isinstance(item, dict):
        raise ProbeFileError(f"{where} must be an object")
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProbeFileError(f"{where}.messages must be a non-empty list")
    try:
        for index, message in enumerate(messages):
            ChatMessage.from_openai(message, where=f"{where}.messages[{index}]")
        tools = item.get("tools")
        if not isinstance(tools, list):
            raise ValueError(f"{where}.tools must be a list")
        if tools:
            validate_tools(tools)
    except ValueError as exc:
        raise ProbeFileError(str(exc)) from None
    token_ids = _ints(item.get("token_ids"), f"{where}.token_ids")
    stop_id = item.get("stop_id")
    if stop_id is not None and not _is_int(stop_id):
        raise ProbeFileError(f"{where}.stop_id must be an integer or null")
    logprobs = item.get("logprobs")
    sampled = len(token_ids) + (stop_id is not None)
    if (
        not isinstance(logprobs, list)
        or len(logprobs) != sampled
        or not all(_is_logprob(x) for x in logprobs)
    ):
        raise ProbeFileError(
            f"{where}.logprobs must hold {sampled} finite numbers <= 0 (one per sampled token)"
        )
    max_tokens = item.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise ProbeFileError(f"{where}.max_tokens must be an integer")
    if not 0 < max_tokens <= 4096 or len(token_ids) > max_tokens:
        raise ProbeFileError(f"{where}.max_tokens must be an integer in 1..4096, >= the tokens")
    task_id, text = item.get("task_id"), item.get("text")
    if not isinstance(task_id, str) or not isinstance(text, str):
        raise ProbeFileError(f"{where}.task_id and {where}.text must be strings")
    margins, runners_up = _runners_up(item, where, sampled)
    return Probe(
        task_id=task_id,
        messages=list(messages),
        tools=list(tools),
        max_tokens=max_tokens,
        prompt_token_ids=_ints(item.get("prompt_token_ids"), f"{where}.prompt_token_ids"),
        token_ids=token_ids,
        stop_id=stop_id,
        logprobs=[float(x) for x in logprobs],
        text=text,
        margins=margins,
        runners_up=runners_up,
    )


def _runners_up(
    item: dict[str, Any], where: str, sampled: int
) -> tuple[list[float] | None, list[int] | None]:
    """``margins`` and ``runners_up``: both absent, or one finite margin >= 0 and one id per
    sampled token."""
    margins, runners_up = item.get("margins"), item.get("runners_up")
    if margins is None and runners_up is None:
        return None, None
    if (
        not isinstance(margins, list)
        or len(margins) != sampled
        or not all(_is_number(x) and x >= 0 for x in margins)
    ):
        raise ProbeFileError(f"{where}.margins must hold {sampled} finite numbers >= 0")
    ids = _ints(runners_up, f"{where}.runners_up")
    if len(ids) != sampled:
        raise ProbeFileError(f"{where}.runners_up must hold {sampled} token ids")
    return [float(x) for x in margins], ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_logprob(value: Any) -> bool:
    return _is_number(value) and value <= 0


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(x) and x >= 0 for x in value):
        raise ProbeFileError(f"{where} must be a list of non-negative integers")
    return list(value)
