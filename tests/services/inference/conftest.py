"""The model server's test checkpoints and server fixture, shared with the engine's tests."""

from tests.services.modelserver.conftest import (
    llama_with_adapters,
    serve,
    tool_calling_llama,
    tool_calling_tiny,
)

__all__ = ["llama_with_adapters", "serve", "tool_calling_llama", "tool_calling_tiny"]
