"""Where winners go: the serving targets (``local``, ``openai`` for vLLM/SGLang/``ratchet
serve``, ``kubernetes`` for a Deployment) that deploy a checkpoint, verify by asking the
server that it is served, prove the delivery and roll back. The model server itself is
:mod:`services.modelserver`. See docs/executors.md and docs/design.md ("Serving")."""

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
