"""The model server's test checkpoints (a random tiny Llama with two LoRA adapters)."""

from tests.services.serving.conftest import llama_with_adapters

__all__ = ["llama_with_adapters"]
