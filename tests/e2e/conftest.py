"""The live stack every end-to-end test drives."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.support import LiveStack


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveStack]:
    # The stack's processes get their settings from the stack alone, never from the
    # environment this test runs in (a developer's RATCHET_LOG_LEVEL, database URL...).
    for key in [key for key in os.environ if key.startswith("RATCHET_")]:
        monkeypatch.delenv(key)
    stack = LiveStack.in_dir(tmp_path / "state")
    try:
        with stack.diagnostics():
            stack.start()
        yield stack
    finally:
        stack.stop()
