"""The serving targets are tested against real model servers: the model server's fixtures."""

from tests.services.modelserver.conftest import checkpoints, serve

__all__ = ["checkpoints", "serve"]
