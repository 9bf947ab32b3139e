"""Small test helpers shared across the suite."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def assert_eventually(
    check: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, message: str = ""
) -> T:
    """Poll ``check`` until it returns without raising AssertionError; return its value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(interval)


async def assert_eventually_async(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
) -> T:
    """Async twin of :func:`assert_eventually`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(interval)
