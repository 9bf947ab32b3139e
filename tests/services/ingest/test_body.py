"""Body reading: limits before, while and after inflating; encodings."""

from __future__ import annotations

import gzip
import threading
from collections.abc import AsyncIterator

import pytest

from services.ingest.body import gunzip_limited, read_body
from services.ingest.errors import IngestError


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_identity_and_gzip_bodies_within_the_limit() -> None:
    assert (
        await read_body(chunks(b"ab", b"c"), content_length="3", content_encoding=None, limit=3)
        == b"abc"
    )
    packed = gzip.compress(b"x" * 100)
    assert (
        await read_body(chunks(packed), content_length=None, content_encoding="GZIP", limit=100)
        == b"x" * 100
    )


@pytest.mark.parametrize(
    ("length", "parts", "encoding", "status"),
    [
        ("999", [b""], None, 413),  # declared too big: refused before reading
        (None, [b"x" * 6, b"x" * 6], None, 413),  # found too big while streaming
        ("abc", [b""], None, 400),
        (None, [b"x"], "br", 415),
        (None, [b"not gzip"], "gzip", 400),
    ],
)
async def test_refusals(
    length: str | None, parts: list[bytes], encoding: str | None, status: int
) -> None:
    with pytest.raises(IngestError) as caught:
        await read_body(chunks(*parts), content_length=length, content_encoding=encoding, limit=10)
    assert caught.value.status_code == status


def test_inflating_stops_at_the_limit_and_handles_several_members() -> None:
    assert gunzip_limited(gzip.compress(b"ab") + gzip.compress(b"cd"), 4) == b"abcd"
    with pytest.raises(IngestError, match="after decompression"):
        gunzip_limited(gzip.compress(b"ab") + gzip.compress(b"cde"), 4)
    with pytest.raises(IngestError, match="after decompression"):
        gunzip_limited(gzip.compress(b"\0" * 50_000_000), 1000)
    with pytest.raises(IngestError, match="truncated"):
        gunzip_limited(gzip.compress(b"abcdef" * 100)[:-10], 10_000)


def test_a_body_of_many_gzip_members_is_refused_before_inflating_them() -> None:
    # 5 MiB of empty members (~262k): today's inflater spent tens of seconds of event loop on
    # these before the signature was checked. Now the 65th member ends the work with a 400.
    empty_member = gzip.compress(b"")
    body = empty_member * (5 * 1024 * 1024 // len(empty_member))
    with pytest.raises(IngestError, match="more than 64 members") as caught:
        gunzip_limited(body, 5 * 1024 * 1024)
    assert caught.value.status_code == 400
    assert gunzip_limited(gzip.compress(b"ab") * 64, 1000) == b"ab" * 64


def test_members_that_straddle_the_inflater_chunks_are_read_whole() -> None:
    # Incompressible members larger than the 64 KiB feed, back to back with small ones.
    big = bytes(range(256)) * 1000
    members = [gzip.compress(big, compresslevel=0), gzip.compress(b"tail"), gzip.compress(big)]
    assert gunzip_limited(b"".join(members), 10 * len(big)) == big + b"tail" + big


async def test_a_big_gzip_body_is_inflated_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[threading.Thread] = []

    def recording_gunzip(data: bytes, limit: int) -> bytes:
        threads.append(threading.current_thread())
        return gunzip_limited(data, limit)

    monkeypatch.setattr("services.ingest.body.gunzip_limited", recording_gunzip)
    packed = gzip.compress(bytes(range(256)) * 2000, compresslevel=0)
    body = await read_body(
        chunks(packed), content_length=None, content_encoding="gzip", limit=1 << 20
    )
    assert len(body) == 512_000
    assert threads and threads[0] is not threading.main_thread()
