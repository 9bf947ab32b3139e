"""The local executor's job slots: at most ``slots`` jobs run on this machine at once, and the
rest wait their turn, loop by loop.

One machine has a fixed number of cores (and GPUs, and memory): a hundred loops whose cycles
all start a job at once would otherwise start a hundred torch processes, each sized for a
share of the machine it does not get, and every one of them would crawl or run out of memory.
Jobs past the slots wait in a queue, and the queue is fair between loops: the next job to
start is the waiting one of the loop served longest ago (then the oldest), so a loop whose
cycle submits many jobs at once, or runs a long one, never keeps another loop's cycle from
its turn. A job's queue time is not its run time: its deadline and accounting start when it
starts.

The queue lives in files under one directory per machine (``<artifact root>/local-jobs``), so
every worker process on the machine shares the same slots and a restarted worker finds them:

- ``<run_id>.json`` — one entry per job that runs or waits (its loop, run directory, when it
  was queued, whether it started); a started entry is dropped once its job has ended;
- ``.served.json`` — when each loop last had a job started (the fairness order);
- ``.lock`` — a file lock held while slots are counted and jobs started.

A waiting job is started by the process that holds its request (the worker following it: a
job's credentials live in that process's memory only, never in a file). Its follower touches
the entry on every poll; an entry nobody touched for ``stale_s`` (its worker died; the
activity's retry submits it again) leaves the queue, so it never blocks the jobs behind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from services.executors.supervise import write_json_atomic

LOCK_FILE = ".lock"
SERVED_FILE = ".served.json"


@dataclass(frozen=True)
class QueueEntry:
    """A job that holds a slot (``started``) or waits for one."""

    run_id: str
    loop: str
    state_dir: str
    queued_at: float
    started: bool = False


@dataclass(frozen=True)
class QueueView:
    """The queue as a dispatch left it: slots busy out of all, and the waiting jobs' run ids
    in the order they will start."""

    running: int
    slots: int
    waiting: tuple[str, ...] = ()

    def ahead_of(self, run_id: str) -> int:
        """Jobs that start before ``run_id`` (all of them if it is not in the view)."""
        return self.waiting.index(run_id) if run_id in self.waiting else len(self.waiting)


class JobQueue:
    """Fair slots for the jobs of one machine, kept in ``directory``. Safe across threads and
    processes (every change happens under the directory's file lock)."""

    def __init__(self, directory: Path, slots: int, *, stale_s: float = 120.0) -> None:
        if slots < 1:
            raise ValueError("a job queue needs at least one slot")
        self.directory = directory
        self.slots = slots
        self._stale_s = stale_s

    # Entries ------------------------------------------------------------------------------

    def enqueue(self, entry: QueueEntry) -> None:
        """Add (or refresh) a waiting job's entry; a started one is left as it is."""
        with self._locked():
            current = self._read(entry.run_id)
            if current is not None and current.started:
                return
            self._write(entry)

    def touch(self, run_id: str) -> bool:
        """Mark a waiting job as followed; False when it has no entry (any more)."""
        try:
            os.utime(self._path(run_id))
        except FileNotFoundError:
            return False
        return True

    def remove(self, run_id: str) -> None:
        with self._locked(), contextlib.suppress(FileNotFoundError):
            self._path(run_id).unlink()

    # Dispatch -----------------------------------------------------------------------------

    def dispatch(
        self, start: Callable[[QueueEntry], bool | None], running: Callable[[QueueEntry], bool]
    ) -> QueueView:
        """Start waiting jobs, in fair order, while slots are free; the queue as it is left.

        ``running(entry)``: whether a started job still runs (one that ended frees its slot).
        ``start(entry)``: start the job and say True; False when this process does not hold
        its request (its own follower starts it: nothing behind it starts first); None when
        the job is no longer to start (cancelled), which drops it from the queue.
        """
        with self._locked():
            entries = self._entries()
            busy = self._busy(entries, running)
            waiting = self._fresh_waiting(entries)
            served = self._served()
            while waiting and busy < self.slots:
                entry = min(waiting, key=lambda e: _fair_key(e, served))
                started = start(entry)
                if started is False:
                    break
                waiting.remove(entry)
                if started is None:
                    self._unlink(entry.run_id)
                    continue
                self._write(QueueEntry(**{**asdict(entry), "started": True}))
                served[entry.loop] = time.time()
                busy += 1
            write_json_atomic(self.directory / SERVED_FILE, served)
            order = sorted(waiting, key=lambda e: _fair_key(e, served))
            return QueueView(busy, self.slots, tuple(e.run_id for e in order))

    # Helpers ------------------------------------------------------------------------------

    def _busy(self, entries: list[QueueEntry], running: Callable[[QueueEntry], bool]) -> int:
        """Started jobs that still run; the entries of those that ended are dropped."""
        busy = 0
        for entry in entries:
            if not entry.started:
                continue
            if running(entry):
                busy += 1
            else:
                self._unlink(entry.run_id)
        return busy

    def _fresh_waiting(self, entries: list[QueueEntry]) -> list[QueueEntry]:
        """Waiting entries someone still follows; stale ones leave the queue."""
        now = time.time()
        fresh = []
        for entry in entries:
            if entry.started:
                continue
            try:
                touched = self._path(entry.run_id).stat().st_mtime
            except FileNotFoundError:
                continue
            if now - touched > self._stale_s:
                self._unlink(entry.run_id)
            else:
                fresh.append(entry)
        return fresh

    def _entries(self) -> list[QueueEntry]:
        found = []
        for path in self.directory.glob("*.json"):
            if path.name.startswith("."):
                continue
            entry = self._read(path.stem)
            if entry is not None:
                found.append(entry)
        return found

    def _served(self) -> dict[str, float]:
        try:
            data = json.loads((self.directory / SERVED_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}

    def _read(self, run_id: str) -> QueueEntry | None:
        try:
            data = json.loads(self._path(run_id).read_text())
            return QueueEntry(**data)
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def _write(self, entry: QueueEntry) -> None:
        write_json_atomic(self._path(entry.run_id), asdict(entry))

    def _unlink(self, run_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(run_id).unlink()

    def _path(self, run_id: str) -> Path:
        return self.directory / f"{run_id}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / LOCK_FILE).open("a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _fair_key(entry: QueueEntry, served: dict[str, float]) -> tuple[float, float]:
    """The loop served longest ago first (a loop never served: first of all), then the
    oldest job."""
    return (served.get(entry.loop, 0.0), entry.queued_at)
