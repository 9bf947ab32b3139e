"""What every serving target shares: the checkpoint reference, the outcome, the errors, and
what a target is built from (:class:`BuildContext`; the kinds are in
:mod:`services.serving.kinds`).

A serving target is where the champion answers production traffic. It has four verbs:
``current()`` (which version is served now), ``deploy(checkpoint)`` (serve this one),
``rollback()`` (serve the previous one again) and ``stats()`` (live numbers). A deploy is
never trusted on the target's word: it ends by asking what is served and fails unless it is
the checkpoint asked for.

Errors say whether a retry can help: :class:`ServingUnavailable` (the server or API did
not answer) may pass; :class:`DeployFailed` (the checkpoint was refused, the rollout failed
or the wrong version is served) will not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from services.settings import ServingEndpoint, Settings


class ServingError(Exception):
    """A serving target could not do what was asked; ``retryable`` says if trying again may."""

    retryable: bool = True


class ServingUnavailable(ServingError):
    """The model server or the cluster API did not answer."""

    retryable = True


class DeployFailed(ServingError):
    """The deploy was refused, did not complete, or left another version serving."""

    retryable = False


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint to serve: its content id (the served version) and where it lives."""

    id: str
    uri: str


@dataclass(frozen=True)
class ServedVersion:
    """What a target says it serves."""

    version: str
    uri: str | None = None
    previous_version: str | None = None


@dataclass(frozen=True)
class DeployOutcome:
    """A verified deploy (or rollback): what is served now, what was before, how long it took."""

    version: str
    previous_version: str | None
    latency_ms: float
    changed: bool = True
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ServingTarget(Protocol):
    kind: str

    def current(self) -> ServedVersion | None:
        """The version served now; None when nothing is served yet."""
        ...

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        """Serve ``checkpoint`` and verify it is what is served. Deploying the served one is a
        no-op."""
        ...

    def rollback(self) -> DeployOutcome:
        """Serve the previously served version again, verified."""
        ...

    def stats(self) -> dict[str, Any]:
        """Live numbers of the target (requests, failures, latency, replicas...)."""
        ...


DEFAULT_MODEL = "ratchet"  # `ratchet serve --served-model-name`'s default


@dataclass(frozen=True)
class BuildContext:
    """What the worker gives a target it builds: its settings, the loop's endpoint (for a
    kind that needs one), a heartbeat for long deploys, and the worker's wiring options."""

    settings: Settings
    endpoint: ServingEndpoint | None = None
    heartbeat: Callable[[str], None] | None = None
    start_local_server: bool = True
    kubernetes_client: Callable[[], Any] | None = None


@dataclass(frozen=True)
class ServerAddress:
    """Where a target's model server answers, as the worker reads its ``/metrics``."""

    url: str
    api_key: str | None = None
    timeout_s: float = 10.0
