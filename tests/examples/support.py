"""The bookshop example's modules, imported as its own scripts import them (its directory on
``sys.path``: ``examples/support-agent`` is a folder of scripts, not a package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "support-agent"


def example_module(name: str) -> ModuleType:
    """``bookshop``, ``tickets``, ``traffic``, ``agent`` or ``mcp_server`` of the example."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    return importlib.import_module(name)
