"""The gateway's local spool: captured calls written before the answer returns, kept until the
writer has them in Postgres.

**Format.** Append-only segment files (``<sequence>.seg``, a new one past
:data:`SEGMENT_BYTES` and at every start) of records framed as ``length (4 bytes, big
endian) | crc32 (4 bytes) | payload``, and a ``cursor`` file naming the first record not yet
in Postgres (segment and offset; replaced atomically).

**Durability.** :meth:`Spool.append` is one ``write(2)`` of the whole record on an
``O_APPEND`` descriptor, done before the answer is sent: once it returns the record is in
the kernel's page cache, so a killed gateway (``kill -9``, an OOM kill, a crash) loses
nothing. A sync thread ``fsync``s the segment (and the directory, when a segment was added)
every ``fsync_s`` while there is something new: the group commit. A power cut or a kernel
crash loses at most the records of the last window. The answer never waits for an fsync.

**Reading.** The writer reads from the cursor on, and moves the cursor (fsync'd) only after
its insert committed; a gateway killed in between drains the same records again after it
restarts, and Postgres keeps each call once (``gateway_calls.call_id`` is unique). A record
cut short by a power cut (its length or crc does not match) ends its segment's readable part
at the next start; it is counted, and the rest of the segment is skipped.

**Bounds.** Past ``max_bytes`` not yet drained, :meth:`append` refuses the record: the
gateway still answers the agent, and counts the call as dropped.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HEADER = struct.Struct(">II")
SEGMENT_BYTES = 16 * 1024 * 1024
CURSOR = "cursor"
SUFFIX = ".seg"
MAX_RECORD = 64 * 1024 * 1024


@dataclass(frozen=True, order=True)
class Position:
    """Where a record ends (the next one starts): segment sequence and byte offset."""

    segment: int
    offset: int


@dataclass(frozen=True)
class Record:
    payload: bytes
    end: Position
    size: int


class Spool:
    """See the module docstring. ``append`` is called on the event loop's thread; ``read``
    and ``commit`` on the writer's; the sync thread runs beside both."""

    def __init__(self, directory: Path, *, max_bytes: int, fsync_s: float) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.fsync_s = fsync_s
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._segment = 0
        self._written = 0  # bytes in the active segment
        self._pending = 0  # bytes not yet committed (across segments)
        self._cursor = Position(0, 0)
        self._dirty = False
        self._new_segment = False
        self._torn = 0
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    # Lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        """Recover what an earlier process left (cursor, torn tails), start a new segment and
        the sync thread."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cursor = self._read_cursor()
        segments = self._segments()
        if segments and self._cursor.segment < segments[0]:
            self._cursor = Position(segments[0], 0)
        pending = 0
        for sequence in segments:
            size = self._valid_length(sequence)
            if size < self._path(sequence).stat().st_size:
                self._torn += 1
                log.warning("gateway spool: segment %d ends in a torn record", sequence)
            start = self._cursor.offset if sequence == self._cursor.segment else 0
            if sequence >= self._cursor.segment:
                pending += max(size - start, 0)
        self._pending = pending
        self._open_segment((segments[-1] + 1) if segments else 1)
        if not segments:
            self._cursor = Position(self._segment, 0)
        self._syncer = threading.Thread(
            target=self._sync_loop, name="gateway-spool-sync", daemon=True
        )
        self._syncer.start()

    def close(self) -> None:
        """Stop the sync thread after a last fsync."""
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join(5)
        self._sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @property
    def pending_bytes(self) -> int:
        return self._pending

    @property
    def torn_records(self) -> int:
        """Records found cut short when the spool was opened (a power cut's last window)."""
        return self._torn

    # Writing ------------------------------------------------------------------------------

    def append(self, payload: bytes) -> bool:
        """Write one record; False (nothing written) when the spool is full."""
        record = HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            if self._fd is None or self._pending + len(record) > self.max_bytes:
                return False
            if self._written >= SEGMENT_BYTES:
                self._open_segment(self._segment + 1)
            assert self._fd is not None
            os.write(self._fd, record)
            self._written += len(record)
            self._pending += len(record)
            self._dirty = True
        return True

    def _open_segment(self, sequence: int) -> None:
        """Make ``sequence`` the active segment (the caller holds the lock, or is ``open``)."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
        path = self._path(sequence)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment, self._written = sequence, os.fstat(self._fd).st_size
        self._new_segment = True
        self._dirty = True

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_s):
            try:
                self._sync()
            except OSError:
                log.exception("gateway spool: fsync failed")

    def _sync(self) -> None:
        with self._lock:
            if not self._dirty or self._fd is None:
                return
            fd, new_segment = os.dup(self._fd), self._new_segment
            self._dirty = self._new_segment = False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if new_segment:
            _fsync_directory(self.directory)

    # Reading ------------------------------------------------------------------------------

    def read(self, limit: int, max_bytes: int = 8 * 1024 * 1024) -> list[Record]:
        """Up to ``limit`` records from the cursor on (never past the last whole record)."""
        records: list[Record] = []
        position = self._cursor
        total = 0
        while len(records) < limit and total < max_bytes:
            found = self._read_segment(position, limit - len(records), max_bytes - total)
            records.extend(found)
            total += sum(r.size for r in found)
            if found:
                position = found[-1].end
            following = [s for s in self._segments() if s > position.segment]
            if len(records) >= limit or not following or self._segment == position.segment:
                break
            if self._readable_end(position):
                position = Position(following[0], 0)
            else:
                break
        return records

    def _read_segment(self, start: Position, limit: int, max_bytes: int) -> list[Record]:
        records: list[Record] = []
        try:
            with self._path(start.segment).open("rb") as fh:
                fh.seek(start.offset)
                offset = start.offset
                while len(records) < limit and max_bytes > 0:
                    header = fh.read(HEADER.size)
                    if len(header) < HEADER.size:
                        break
                    length, crc = HEADER.unpack(header)
                    payload = fh.read(length) if length <= MAX_RECORD else b""
                    if len(payload) < length or zlib.crc32(payload) != crc:
                        break
                    offset += HEADER.size + length
                    size = HEADER.size + length
                    records.append(Record(payload, Position(start.segment, offset), size))
                    max_bytes -= size
        except FileNotFoundError:
            pass
        return records

    def _readable_end(self, position: Position) -> bool:
        """Whether ``position`` is the end of what its (no longer active) segment holds that
        can be read: its end, or a torn record the rest of which is skipped."""
        return self._valid_length(position.segment) <= position.offset

    def commit(self, position: Position, size: int) -> None:
        """Records up to ``position`` are in Postgres: move the cursor, drop used segments."""
        self._write_cursor(position)
        with self._lock:
            self._cursor = position
            self._pending = max(self._pending - size, 0)
            active = self._segment
        for sequence in self._segments():
            if sequence < position.segment and sequence != active:
                self._path(sequence).unlink(missing_ok=True)

    def _valid_length(self, sequence: int) -> int:
        """Bytes of whole records at the start of a segment."""
        path = self._path(sequence)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        offset = 0
        with path.open("rb") as fh:
            while offset + HEADER.size <= size:
                fh.seek(offset)
                length, crc = HEADER.unpack(fh.read(HEADER.size))
                if length > MAX_RECORD or offset + HEADER.size + length > size:
                    break
                if zlib.crc32(fh.read(length)) != crc:
                    break
                offset += HEADER.size + length
        return offset

    # Files --------------------------------------------------------------------------------

    def _path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:012d}{SUFFIX}"

    def _segments(self) -> list[int]:
        return sorted(
            int(path.name.removesuffix(SUFFIX))
            for path in self.directory.glob(f"*{SUFFIX}")
            if path.name.removesuffix(SUFFIX).isdigit()
        )

    def _read_cursor(self) -> Position:
        try:
            raw = json.loads((self.directory / CURSOR).read_text())
            return Position(int(raw["segment"]), int(raw["offset"]))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return Position(0, 0)

    def _write_cursor(self, position: Position) -> None:
        temporary = self.directory / f"{CURSOR}.tmp"
        with temporary.open("w") as fh:
            json.dump({"segment": position.segment, "offset": position.offset}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        temporary.replace(self.directory / CURSOR)
        _fsync_directory(self.directory)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
