"""Where winners go: the OpenAI-compatible model server (``ratchet serve``: batched, hot
swapping full models and LoRA adapters) and the serving targets (``local``, ``openai`` for
vLLM/SGLang/``ratchet serve``, ``kubernetes`` for a Deployment) that deploy a checkpoint
and verify, by asking the server, that it is served. See docs/executors.md."""

from services.serving.base import (
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServedVersion,
    ServingError,
    ServingTarget,
    ServingUnavailable,
)

__all__ = [
    "CheckpointRef",
    "DeployFailed",
    "DeployOutcome",
    "ServedVersion",
    "ServingError",
    "ServingTarget",
    "ServingUnavailable",
]
