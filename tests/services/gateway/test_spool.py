"""The spool on its own: records read back in order across segments and restarts, the cursor
moved only by a commit, a torn tail skipped, a full spool refusing (never blocking)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway import spool as spool_module
from services.gateway.spool import Spool


def opened(path: Path, max_bytes: int = 1 << 20) -> Spool:
    spool = Spool(path, max_bytes=max_bytes, fsync_s=0.01)
    spool.open()
    return spool


def test_records_come_back_in_order_until_committed_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    spool = opened(tmp_path)
    for index in range(5):
        assert spool.append(f"r{index}".encode())
    first = spool.read(2)
    assert [r.payload for r in first] == [b"r0", b"r1"]
    assert [r.payload for r in spool.read(2)] == [b"r0", b"r1"]  # nothing moves without commit
    spool.commit(first[-1].end, sum(r.size for r in first))
    spool.close()

    again = opened(tmp_path)  # a restart: the rest is still there, and new records follow
    assert again.append(b"r5")
    assert [r.payload for r in again.read(10)] == [b"r2", b"r3", b"r4", b"r5"]
    assert again.pending_bytes == sum(r.size for r in again.read(10))
    again.close()


def test_records_span_segments_and_used_segments_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 64)
    spool = opened(tmp_path)
    payloads = [bytes([65 + i]) * 30 for i in range(6)]
    for payload in payloads:
        assert spool.append(payload)
    records = spool.read(100)
    assert [r.payload for r in records] == payloads
    spool.commit(records[-1].end, sum(r.size for r in records))
    assert len(list(tmp_path.glob("*.seg"))) == 1
    assert spool.pending_bytes == 0
    spool.close()


def test_a_torn_tail_is_skipped_and_counted(tmp_path: Path) -> None:
    spool = opened(tmp_path)
    spool.append(b"whole")
    spool.close()
    segment = sorted(tmp_path.glob("*.seg"))[-1]
    with segment.open("ab") as fh:  # a power cut in the middle of a record
        fh.write(b"\x00\x00\x01\x00torn")

    again = opened(tmp_path)
    again.append(b"after")
    assert again.torn_records == 1
    assert [r.payload for r in again.read(10)] == [b"whole", b"after"]
    again.close()


def test_a_full_spool_refuses_without_writing(tmp_path: Path) -> None:
    spool = opened(tmp_path, max_bytes=64 * 1024)
    big = b"x" * 30_000
    assert spool.append(big) and spool.append(big)
    assert not spool.append(big)
    assert len(spool.read(10)) == 2
    spool.close()
