"""Reading request bodies without trusting them: size limits before and after decompression.

A body is refused as soon as it is known to be too big: from ``Content-Length`` before a byte
is read, while streaming, and while inflating gzip (a 10 KB gzip bomb that inflates to 10 GB
stops at the limit, never in memory). The limit applies to the decompressed size, as OTLP/HTTP
requires.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from services.ingest.errors import IngestError

_GZIP = {"gzip", "x-gzip"}
_IDENTITY = {"", "identity"}


def _too_large(limit: int, after: str = "") -> IngestError:
    return IngestError(
        413,
        "body_too_large",
        f"the request body is over the limit of {limit} bytes{after}; send smaller batches",
    )


def check_encoding(content_encoding: str | None) -> bool:
    """Whether the body is gzip; any encoding but gzip and identity is a 415."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in _GZIP:
        return True
    if encoding in _IDENTITY:
        return False
    raise IngestError(
        415,
        "unsupported_encoding",
        f"Content-Encoding {encoding!r} is not supported; use gzip or none",
    )


def check_declared_length(content_length: str | None, limit: int) -> None:
    """Refuse a body whose declared length is already over the limit (before reading it)."""
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        raise IngestError(400, "invalid_header", "Content-Length is not a number") from None
    if declared > limit:
        raise _too_large(limit)


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The raw body, or a 413 as soon as it passes ``limit`` bytes."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


# Input is fed to the inflater this many bytes at a time, so what zlib copies into
# ``unused_data`` when a member ends is at most one chunk, never the rest of the body (which
# made inflating quadratic in the member count: 80k empty members took 3.6 s).
_INFLATE_CHUNK = 64 * 1024
# Real senders write one member (OTLP exporters, gzip -c); concatenations of a few are legal.
# Thousands are only ever an attack on the inflater, so they are refused without inflating.
MAX_GZIP_MEMBERS = 64
# Bodies bigger than this are inflated on a worker thread, so the event loop keeps serving.
_INLINE_INFLATE_BYTES = 64 * 1024


def gunzip_limited(data: bytes, limit: int, *, max_members: int = MAX_GZIP_MEMBERS) -> bytes:
    """Inflate gzip data (one or more members) to at most ``limit`` bytes, else a 413.

    Linear in the size of ``data``: the input goes in bounded chunks and each member starts at
    an offset into one buffer; at most ``max_members`` members are read (400 beyond).
    """
    out = bytearray()
    view = memoryview(data)
    position = 0
    members = 0
    while position < len(view):
        members += 1
        if members > max_members:
            raise IngestError(
                400,
                "invalid_gzip",
                f"the gzip body has more than {max_members} members; send one gzip stream",
            )
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        while not inflater.eof:
            if position >= len(view):
                raise IngestError(400, "invalid_gzip", "the gzip body is truncated")
            chunk = view[position : position + _INFLATE_CHUNK]
            try:
                out += inflater.decompress(chunk, limit + 1 - len(out))
            except zlib.error as exc:
                raise IngestError(400, "invalid_gzip", f"the gzip body is corrupt: {exc}") from None
            if len(out) > limit or inflater.unconsumed_tail:
                raise _too_large(limit, " after decompression")
            position += len(chunk) - len(inflater.unused_data)
    return bytes(out)


async def inflate(data: bytes, limit: int) -> bytes:
    """:func:`gunzip_limited`, on a worker thread when the body is big enough to matter."""
    if len(data) <= _INLINE_INFLATE_BYTES:
        return gunzip_limited(data, limit)
    return await asyncio.to_thread(gunzip_limited, data, limit)


async def read_body(
    chunks: AsyncIterator[bytes],
    *,
    content_length: str | None,
    content_encoding: str | None,
    limit: int,
) -> bytes:
    """Read and, when gzip, inflate a body; every size check is against ``limit``."""
    gzipped = check_encoding(content_encoding)
    check_declared_length(content_length, limit)
    raw = await read_limited(chunks, limit)
    return await inflate(raw, limit) if gzipped else raw
