"""The last lines of a run's log, read safely from its ``logs_uri``.

Runs record where their logs are; the local executor writes a file and records a
``file://`` URI. The dashboard shows its tail, but a URI in a database row is not a licence
to read any file on the api's host: only regular files under the allowed roots (the state
and artifact directories) are read, symlinks are resolved before the check, only the last
``max_bytes`` are read, and terminal escape sequences are stripped. Anything else (a
Kubernetes run whose logs live in the cluster, a missing file) gets a sentence instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

_ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class LogsTail:
    """What the run page shows: lines, or why there are none."""

    lines: list[str] = field(default_factory=list)
    truncated: bool = False
    path: str | None = None
    unavailable: str | None = None


def clean_line(line: str) -> str:
    """A log line without terminal escapes or control characters (tabs are kept)."""
    return _CONTROL.sub("", _ANSI_ESCAPE.sub("", line.rstrip("\r")))


def _within(path: Path, roots: Sequence[Path]) -> bool:
    for root in roots:
        try:
            resolved_root = root.expanduser().resolve()
        except OSError:
            continue
        if path == resolved_root or path.is_relative_to(resolved_root):
            return True
    return False


def _file_path(uri: str) -> Path | str:
    """The local path of a ``file://`` URI, or the reason it is not one we read."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return f"logs are kept by the executor at {uri}"
    if parts.netloc not in ("", "localhost"):
        return f"logs are on another host ({parts.netloc})"
    path = Path(unquote(parts.path))
    if not path.is_absolute():
        return "the logs URI is not an absolute file path"
    return path


def read_logs_tail(
    uri: str | None,
    *,
    allowed_roots: Sequence[Path],
    max_bytes: int = 64 * 1024,
    max_lines: int = 200,
) -> LogsTail:
    """The last ``max_lines`` lines (from at most the last ``max_bytes``) of a log file."""
    if max_bytes < 1 or max_lines < 1:
        raise ValueError("max_bytes and max_lines must be positive")
    if not uri:
        return LogsTail(unavailable="this run has not recorded any logs yet")
    located = _file_path(uri)
    if isinstance(located, str):
        return LogsTail(unavailable=located)
    try:
        path = located.resolve(strict=True)
    except (OSError, RuntimeError):
        return LogsTail(path=str(located), unavailable="the log file does not exist (yet)")
    if not _within(path, allowed_roots):
        return LogsTail(
            path=str(located),
            unavailable="the log file is outside Ratchet's state and artifact directories",
        )
    if not path.is_file():
        return LogsTail(path=str(located), unavailable="the logs URI is not a regular file")
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            start = max(0, size - max_bytes)
            handle.seek(start)
            data = handle.read(max_bytes)
    except OSError as exc:
        return LogsTail(path=str(located), unavailable=f"cannot read the log file: {exc.strerror}")
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if start > 0:
        lines = lines[1:]  # the first line was cut in the middle
    if lines and lines[-1] == "":
        lines.pop()
    truncated = start > 0 or len(lines) > max_lines
    return LogsTail(
        lines=[clean_line(line) for line in lines[-max_lines:]],
        truncated=truncated,
        path=str(located),
    )
