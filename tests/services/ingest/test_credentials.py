"""The credential cache: requests that find an entry stale at once share one read."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from services.ingest.credentials import CredentialCache, LoopKeys, LruTable, TokenLoop, hash_token
from services.ingest.writer import StorageUnavailable

MADE_UP_TOKENS = {hash_token(f"rit_made_up_{number}") for number in range(10)}


class CountingReads:
    """Stands in for the Postgres reads: counts them, takes a while, may fail."""

    def __init__(self) -> None:
        self.calls = 0
        self.name_reads = 0
        self.fail = False
        self.names = frozenset({"a", "b", "c"})
        self.token_digests = frozenset(hash_token(t) for t in ("rit_x", "rit_good"))
        self.lock = threading.Lock()

    def loop_names(self) -> tuple[frozenset[str], frozenset[str]]:
        with self.lock:
            self.name_reads += 1
        return self.names, self.token_digests

    def loop(self, name: str) -> LoopKeys | None:
        with self.lock:
            self.calls += 1
        time.sleep(0.05)
        if self.fail:
            raise OperationalError("SELECT", {}, Exception("connection refused"))
        return LoopKeys(1, name, "active", ())

    def token(self, digest: str) -> TokenLoop | None:
        with self.lock:
            self.calls += 1
        time.sleep(0.05)
        return None if digest in MADE_UP_TOKENS else TokenLoop(1, "l", "active", None)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> CountingReads:
    fake = CountingReads()
    monkeypatch.setattr(CredentialCache, "_read_loop", lambda self, name: fake.loop(name))
    monkeypatch.setattr(CredentialCache, "_read_token", lambda self, digest: fake.token(digest))
    monkeypatch.setattr(CredentialCache, "_read_names", lambda self, _: fake.loop_names())
    return fake


async def test_concurrent_misses_share_one_read(reads: CountingReads) -> None:
    cache = CredentialCache(None, ttl_s=30)  # type: ignore[arg-type]
    found = await asyncio.gather(*(cache.loop_keys("a") for _ in range(20)))
    assert reads.calls == 1 and {keys.name for keys in found if keys} == {"a"}
    await cache.loop_keys("a")  # fresh: no read
    await asyncio.gather(cache.loop_keys("b"), cache.loop_keys("c"))  # other names: their own
    assert reads.calls == 3
    tokens = await asyncio.gather(*(cache.token_loop("rit_x") for _ in range(5)))
    assert reads.calls == 4 and all(t == tokens[0] for t in tokens)


async def test_a_caller_that_hangs_up_does_not_cancel_the_read_for_others(
    reads: CountingReads,
) -> None:
    cache = CredentialCache(None)  # type: ignore[arg-type]
    first = asyncio.create_task(cache.loop_keys("a"))
    second = asyncio.create_task(cache.loop_keys("a"))
    await asyncio.sleep(0.01)
    first.cancel()
    keys = await second
    assert keys is not None and keys.name == "a" and reads.calls == 1


async def test_a_failed_read_reaches_every_caller_and_the_next_one_reads_again(
    reads: CountingReads,
) -> None:
    cache = CredentialCache(None)  # type: ignore[arg-type]
    reads.fail = True
    results = await asyncio.gather(
        *(cache.loop_keys("a") for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, StorageUnavailable) for r in results) and reads.calls == 1
    reads.fail = False
    keys = await cache.loop_keys("a")
    assert keys is not None and reads.calls == 2


async def test_made_up_loop_names_cost_no_query_each_and_evict_nothing(
    reads: CountingReads,
) -> None:
    cache = CredentialCache(None, capacity=100)  # type: ignore[arg-type]
    assert await cache.loop_keys("a") is not None
    assert (reads.calls, reads.name_reads) == (1, 1)
    for number in range(20_000):
        assert await cache.loop_keys(f"random-{number}") is None
    # One list of names answered all of them (it is re-read at most once per second).
    assert reads.calls == 1 and reads.name_reads <= 2
    assert await cache.loop_keys("a") is not None and reads.calls == 1  # still cached


async def test_made_up_tokens_cost_no_query_each_and_do_not_push_out_valid_ones(
    reads: CountingReads,
) -> None:
    cache = CredentialCache(None, capacity=3)  # type: ignore[arg-type]
    assert await cache.token_loop("rit_good") is not None
    reads.calls = 0
    for number in range(10):
        assert await cache.token_loop(f"rit_made_up_{number}") is None
    assert reads.calls == 0 and reads.name_reads <= 2  # the list of digests answered
    # A token that exists but is not cached yet is looked up; the cached one still is.
    reads.token_digests = reads.token_digests | MADE_UP_TOKENS
    cache.invalidate("l")  # (what a rotation in this process does)
    for number in range(5):
        assert await cache.token_loop(f"rit_made_up_{number}") is None
    assert reads.calls == 5
    assert await cache.token_loop("rit_good") is not None


def test_the_lru_drops_the_least_recently_used() -> None:
    from services.ingest.credentials import _Entry

    table: LruTable[int] = LruTable(capacity=2)
    table.put("a", _Entry(1, 0.0))
    table.put("b", _Entry(2, 0.0))
    assert table.get("a") is not None  # a is now the most recent
    table.put("c", _Entry(3, 0.0))
    assert "a" in table and "c" in table and "b" not in table and len(table) == 2
