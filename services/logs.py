"""Structured logging: JSON lines in a cluster, readable lines on a terminal.

Every line carries the ids in scope (loop, cycle, run, workflow) from :func:`log_context`, so
one grep follows a cycle across api, worker and jobs.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Literal

from services.chat.text import valid_json, valid_text

_CONTEXT: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "ratchet_log_context", default=MappingProxyType({})
)
CONTEXT_KEYS = ("loop", "cycle", "run", "workflow_id", "component")


@contextlib.contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """Attach ids (loop=..., cycle=..., run=...) to every log line inside the block."""
    merged = {**_CONTEXT.get(), **{k: v for k, v in ids.items() if v is not None}}
    token = _CONTEXT.set(merged)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line with time, level, logger, message and context ids."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, tz=dt.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value is not None:
                payload[key] = value
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            payload.update(extra)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(valid_json(payload), default=str)  # model text in a message too


class TextFormatter(logging.Formatter):
    """Readable lines for a terminal, with the context ids appended."""

    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.name}: "
        base += record.getMessage()
        ids = " ".join(
            f"{key}={getattr(record, key)}"
            for key in CONTEXT_KEYS
            if getattr(record, key, None) is not None
        )
        if ids:
            base += f"  [{ids}]"
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return valid_text(base)


def configure_logging(
    level: str = "INFO",
    log_format: Literal["auto", "json", "text"] = "auto",
    *,
    component: str | None = None,
) -> None:
    """Install one handler on the root logger (idempotent)."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, "_ratchet", False):
            root.removeHandler(existing)
    handler._ratchet = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "kubernetes.client.rest"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if component is not None:
        _CONTEXT.set({**_CONTEXT.get(), "component": component})
