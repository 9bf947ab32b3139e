"""The demo's agent runs against a real model server and the real api: their fixtures."""

from tests.services.api.conftest import app_state, settings
from tests.services.modelserver.conftest import checkpoints, serve, tool_calling_tiny

__all__ = ["app_state", "checkpoints", "serve", "settings", "tool_calling_tiny"]
