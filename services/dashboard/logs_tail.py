"""The last lines of a run's log, read safely from its ``logs_uri``.

Runs record where their logs are; the local executor writes a file and records a
``file://`` URI. The dashboard shows its tail, but a URI in a database row is not a licence
to read any file on the api's host: only regular files under the allowed roots (the state
and artifact directories), and on the run page only inside the run's own directory, are
read. A job can plant links in its run directory, so no link is followed below a root
(``O_NOFOLLOW`` on every component, see :mod:`services.executors.runfiles`), a FIFO or
device is refused, only the last ``max_bytes`` are read, and terminal escape sequences are
stripped. Anything else (a
Kubernetes run whose logs live in the cluster, a missing file) gets a sentence instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from urllib.parse import unquote, urlsplit

from services.executors.runfiles import (
    UnsafeRunFile,
    open_for_reading,
    read_tail_bytes,
    relative_parts,
)

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


def _root_of(path: Path, roots: Sequence[Path], within: PurePath | None) -> Path | str:
    """The allowed root ``path`` lies under (``within`` it, when given), or why none.

    Compared without resolving ``path``; the state dir usually holds the artifact root, so
    a file can be under two roots, and ``within`` is relative to the one that holds it.
    """
    inside_a_root = False
    for root in roots:
        try:
            parts = relative_parts(root, path)
        except UnsafeRunFile:
            continue
        inside_a_root = True
        if within is None or PurePath(*parts).is_relative_to(within):
            return root
    if inside_a_root:
        return "the log file is outside the run's own directory"
    return "the log file is outside Ratchet's state and artifact directories"


def _open_log(
    located: Path, roots: Sequence[Path], within: PurePath | None
) -> tuple[Path, int] | str:
    """The root and a descriptor of the log file, or why it is not read."""
    root = _root_of(located, roots, within)
    if isinstance(root, str):
        return root
    try:
        return root, open_for_reading(root, located)
    except FileNotFoundError:
        return "the log file does not exist (yet)"
    except UnsafeRunFile as exc:
        if "symbolic link" in str(exc):
            return "the log file (or a directory on its way) is a symbolic link: not followed"
        return "the logs URI is not a regular file"
    except OSError as exc:
        return f"cannot read the log file: {exc.strerror}"


def read_logs_tail(
    uri: str | None,
    *,
    allowed_roots: Sequence[Path],
    within: PurePath | None = None,
    max_bytes: int = 64 * 1024,
    max_lines: int = 200,
) -> LogsTail:
    """The last ``max_lines`` lines (from at most the last ``max_bytes``) of a log file.

    ``within`` (relative to the root, e.g. ``loops/<loop>/runs/<run id>``) keeps the read
    inside one run's own directory.
    """
    if max_bytes < 1 or max_lines < 1:
        raise ValueError("max_bytes and max_lines must be positive")
    if not uri:
        return LogsTail(unavailable="this run has not recorded any logs yet")
    located = _file_path(uri)
    if isinstance(located, str):
        return LogsTail(unavailable=located)
    opened = _open_log(located, allowed_roots, within)
    if isinstance(opened, str):
        return LogsTail(path=str(located), unavailable=opened)
    try:
        data, start = read_tail_bytes(opened[1], max_bytes)
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
