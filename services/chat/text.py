"""Model text as it leaves a model: valid Unicode, by one rule for every writer and reader.

The byte-level tokenizer decodes sampled ids with ``surrogateescape``: a byte that is not
UTF-8 becomes a lone surrogate (``"\\udcf9"`` for 0xF9), so that ``encode(decode(ids))``
gives back exactly the ids that were sampled, which a rollout re-encoding its transcript
needs. Inside a job that is right. Outside it is poison: Postgres ``text`` and ``jsonb``
cannot hold a lone surrogate, ``json.dumps`` writes it as an escape (``"\\udcf9"``) that
every strict reader refuses, and a UTF-8 encoder raises on it. One demo cycle in two failed
that way (issue 43), by what the tiny model happened to sample.

So the rule is: **no text leaves a model with a lone surrogate in it.** Each becomes U+FFFD,
the replacement character, as ``bytes.decode("utf-8", "replace")`` would have made it
(a well-formed surrogate pair, which only hand-built strings hold, is joined into its
character). A NUL character (byte 0, which the byte tokenizer can sample too) goes the same
way: Postgres ``text`` and ``jsonb`` cannot hold it either. Where it is applied:

- in the jobs, by every writer of model text: episode and demonstration lines
  (``EpisodeRecord.to_json``), evaluation results (``TaskResult.to_dict``), probe sets
  (``write_probes``);
- in the worker, by every reader of job output (:func:`load_job_json`): a job in another image need
  not follow the rule, and what it wrote still reaches Postgres whole;
- in the logs (``services.logs``' JSON lines);
- in the capture gateway, which passes text between an agent and a model it did not write:
  what it sends on is encoded by :func:`utf8_json` (a lone surrogate an agent escaped in its
  JSON is passed on escaped, never a ``UnicodeEncodeError``), and what it stores by
  :func:`storable_json` (a NUL or a lone surrogate in a conversation or a reply becomes U+FFFD
  in ``gateway_calls.body``, and the call is kept, not refused).

Standard library only: every process imports it, GPU jobs included.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

REPLACEMENT = "\ufffd"
# A JSON string escape of a UTF-16 surrogate or of NUL: the only way either can come out of
# a UTF-8 file (the strict decoder refuses encoded surrogates, JSON refuses a raw NUL).
_UNSTORABLE_ESCAPE = re.compile(r"\\u(?:[dD][89abcdefABCDEF]|0000)")


class JobJsonError(ValueError):
    """Job output that is not JSON a database can hold (a NaN or an infinity)."""


def valid_text(text: str) -> str:
    """``text`` with every lone surrogate and NUL replaced by U+FFFD (see the module)."""
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def valid_json(value: Any) -> Any:
    """A JSON value (dicts, lists, strings, numbers) with every string, keys too, made
    :func:`valid_text`; values of other types are returned as they are."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_json(k): valid_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_json(item) for item in value]
    return value


def utf8_json(value: Any, *, compact: bool = False) -> bytes:
    """``value`` as UTF-8 JSON for the wire or a file: non-ASCII text as itself, except where
    a string holds a lone surrogate (only an escape in the JSON it came from can make one),
    which UTF-8 cannot encode: then all of it as ASCII escapes, which say the same."""
    separators = (",", ":") if compact else None
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=separators).encode()


def storable_json(value: Any) -> str:
    """``value`` as JSON text Postgres ``jsonb`` can hold: every string :func:`valid_text`,
    walked only when the text holds a NUL or surrogate escape (one regex scan otherwise)."""
    text = json.dumps(value)
    return json.dumps(valid_json(value)) if _UNSTORABLE_ESCAPE.search(text) else text


def load_job_json(text: str) -> Any:
    """Job output parsed as the worker stores it: lone surrogates and NULs replaced (only
    walked when the text holds such an escape, so clean output costs one regex scan), and
    ``NaN``/``Infinity`` refused with :class:`JobJsonError` (JSON has no such numbers and
    Postgres ``jsonb`` refuses them: a run carrying one could never be recorded).
    ``json.JSONDecodeError`` and ``RecursionError`` as ``json.loads`` raises them."""
    value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    return valid_json(value) if _UNSTORABLE_ESCAPE.search(text) else value


def _refuse_constant(name: str) -> Any:
    raise JobJsonError(f"{name} is not a JSON number (a run's outputs must be finite)")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise JobJsonError(f"{literal[:32]} is out of range (a run's outputs must be finite)")
    return value
