"""replay: tasks from any OpenAI-tools agent's traces, tools replayed from recorded results.

The package's names load on first use (PEP 562): importing one light module of it
(``matching``, ``facts``, ``records``), as the loop's policies do, must not load the
environment, its HTTP and MCP clients, and everything they import. Temporal's workflow
sandbox re-imports a module that defines workflows, and refuses a class built on
``urllib.request`` at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.environments.replay.env import ENVIRONMENT_NAME, REWARD_ID, ReplayEnvironment
    from services.environments.replay.judge import Judge, JudgeEndpoint, JudgeError
    from services.environments.replay.records import STORE_FILE, RecordedCall, recorded_calls
    from services.environments.replay.tool_config import ToolEndpointConfig
    from services.environments.replay.tool_endpoints import LiveToolEndpoint

_HOMES = {
    "ENVIRONMENT_NAME": "env",
    "REWARD_ID": "env",
    "ReplayEnvironment": "env",
    "Judge": "judge",
    "JudgeEndpoint": "judge",
    "JudgeError": "judge",
    "STORE_FILE": "records",
    "RecordedCall": "records",
    "recorded_calls": "records",
    "ToolEndpointConfig": "tool_config",
    "LiveToolEndpoint": "tool_endpoints",
}

__all__ = [
    "ENVIRONMENT_NAME",
    "REWARD_ID",
    "STORE_FILE",
    "Judge",
    "JudgeEndpoint",
    "JudgeError",
    "LiveToolEndpoint",
    "RecordedCall",
    "ReplayEnvironment",
    "ToolEndpointConfig",
    "recorded_calls",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
