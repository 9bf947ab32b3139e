"""Where winners go: the local model server with hot swap, and the serving targets (local,
Kubernetes Deployment) that deploy a checkpoint and verify it is served. See
docs/executors.md."""

from services.serving.base import (
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    RequestRefused,
    ServedVersion,
    ServingError,
    ServingTarget,
    ServingUnavailable,
)

__all__ = [
    "CheckpointRef",
    "DeployFailed",
    "DeployOutcome",
    "RequestRefused",
    "ServedVersion",
    "ServingError",
    "ServingTarget",
    "ServingUnavailable",
]
