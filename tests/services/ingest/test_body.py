"""Body reading: limits before, while and after inflating; encodings."""

from __future__ import annotations

import gzip
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
