"""Progress of long CLI work: a bar on a terminal, plain lines in a log or a pipe.

``ratchet datasets export`` and the demo's champion SFT report through :class:`Progress`.
On a terminal it draws a rich progress bar (rate, time left); otherwise — CI logs, ``| tee``,
a file — it writes a plain line at most every ``interval_s`` seconds and one at the end,
so logs stay readable and never fill with carriage returns.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO


class Progress:
    """``with Progress("copying", total=n, unit="B") as p: p.advance(k)``; total may be None."""

    def __init__(
        self,
        description: str,
        *,
        total: float | None,
        unit: str = "",
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        force_terminal: bool | None = None,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.completed = 0.0
        self.failed = False  # set when the work ended badly: the last line says so
        self._stream = stream if stream is not None else sys.stderr
        self._interval_s = interval_s
        self._last_line = 0.0
        terminal = force_terminal if force_terminal is not None else _is_terminal(self._stream)
        self._bar: Any = None
        self._task: Any = None
        if terminal:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
            if unit == "B":
                columns += [DownloadColumn(), TransferSpeedColumn()]
            else:
                columns += [MofNCompleteColumn()]
            columns.append(TimeRemainingColumn())
            console = Console(file=self._stream, force_terminal=True)
            self._bar = RichProgress(*columns, console=console, transient=False)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        self._last_line = time.monotonic()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.failed = True
        if self._bar is not None:
            self._bar.stop()
        else:
            self._line(done=not self.failed)

    def advance(self, amount: float = 1) -> None:
        self.update(self.completed + amount)

    def update(self, completed: float, *, total: float | None = None) -> None:
        """Set how much is done (and the total, when it becomes known on the way)."""
        self.completed = completed
        if total is not None:
            self.total = total
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, total=self.total)
            return
        now = time.monotonic()
        if now - self._last_line >= self._interval_s:
            self._last_line = now
            self._line()

    def _line(self, *, done: bool = False) -> None:
        amount = _format(self.completed, self.unit)
        if self.total:
            share = f" ({100 * self.completed / self.total:.0f}%)"
            amount = f"{amount}/{_format(self.total, self.unit)}{share}"
        state = "done" if done else "failed" if self.failed else "..."
        print(f"{self.description}: {amount} {state}", file=self._stream, flush=True)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _format(value: float, unit: str) -> str:
    if unit == "B":
        for suffix, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= size:
                return f"{value / size:.1f} {suffix}"
        return f"{value:.0f} B"
    text = f"{value:.0f}"
    return f"{text} {unit}".rstrip()
