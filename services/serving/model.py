"""The served model and its hot swap.

:class:`ModelSlot` holds the model that answers requests. A swap loads the new checkpoint
beside the old one (requests keep being answered by the old one meanwhile), verifies it —
every file against the manifest's sha256 (by :func:`Policy.load`), finite weights, and a
smoke generation — and only then replaces the reference in one assignment. A request takes
the reference once when it starts and uses that model to the end, so a swap never changes
a model under a request and never fails one; the response names the version that answered.

The previous model stays loaded, so a rollback is the same switch in the other direction.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.training.checkpoint import CheckpointError, read_manifest
from services.training.policy import Policy

logger = logging.getLogger(__name__)

SMOKE_PROMPT = "tools: +add(a,b)\nuser: 1+1\n> "
SMOKE_TOKENS = 4


class SwapRefused(Exception):
    """The new checkpoint failed verification; the old model keeps serving."""


@dataclass(frozen=True)
class LoadedModel:
    """A verified, loaded checkpoint: its content id is the served version."""

    version: str
    path: Path
    policy: Policy
    loaded_at: float


@dataclass(frozen=True)
class SwapReport:
    version: str
    previous_version: str | None
    changed: bool
    load_ms: float


def load_model(
    path: Path, *, device: str = "auto", expected_version: str | None = None
) -> LoadedModel:
    """Load and verify a checkpoint directory; raise :class:`SwapRefused` saying why not."""
    try:
        policy = Policy.load(path, device=device)
    except CheckpointError as exc:
        raise SwapRefused(str(exc)) from exc
    version = policy.checkpoint_id or ""
    if expected_version is not None and version != expected_version:
        raise SwapRefused(
            f"checkpoint {path} is {version[:12]}, not the expected {expected_version[:12]}"
        )
    smoke_check(policy)
    return LoadedModel(version=version, path=path, policy=policy, loaded_at=time.time())


def smoke_check(policy: Policy) -> None:
    """Refuse a model that cannot serve: non-finite weights, or a generation that fails."""
    for name, tensor in policy.model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SwapRefused(f"weight {name} has non-finite values")
    try:
        texts = policy.generate([SMOKE_PROMPT], max_new_tokens=SMOKE_TOKENS, temperature=0.0)
    except (RuntimeError, ValueError) as exc:
        raise SwapRefused(f"smoke generation failed: {exc}") from exc
    if len(texts) != 1 or not isinstance(texts[0], str):
        raise SwapRefused("smoke generation returned no text")


class ModelSlot:
    """The served model, swapped atomically. Safe to use from many threads."""

    def __init__(self, model: LoadedModel, *, device: str = "auto") -> None:
        self._current = model
        self._previous: LoadedModel | None = None
        self._device = device
        self._swap_lock = threading.Lock()
        self.swaps = 0

    @property
    def current(self) -> LoadedModel:
        """The model to answer with; take it once per request."""
        return self._current

    @property
    def previous(self) -> LoadedModel | None:
        return self._previous

    def swap(self, path: Path, *, expected_version: str | None = None) -> SwapReport:
        """Serve the checkpoint at ``path``; a no-op when it is the version served now."""
        with self._swap_lock:
            current = self._current
            if _manifest_id(path) == current.version and expected_version in (
                None,
                current.version,
            ):
                return SwapReport(current.version, current.version, changed=False, load_ms=0.0)
            started = time.perf_counter()
            new = load_model(path, device=self._device, expected_version=expected_version)
            load_ms = (time.perf_counter() - started) * 1000.0
            self._previous, self._current = current, new  # the switch: one assignment
            self.swaps += 1
        logger.info("now serving %s (was %s)", new.version[:12], current.version[:12])
        return SwapReport(new.version, current.version, changed=True, load_ms=load_ms)

    def rollback(self) -> SwapReport:
        """Serve the previous model again (it is still loaded and was verified)."""
        with self._swap_lock:
            previous, current = self._previous, self._current
            if previous is None:
                raise SwapRefused("there is no previous model to roll back to")
            self._previous, self._current = current, previous
            self.swaps += 1
        logger.info("rolled back to %s (from %s)", previous.version[:12], current.version[:12])
        return SwapReport(previous.version, current.version, changed=True, load_ms=0.0)


def _manifest_id(path: Path) -> str | None:
    try:
        return read_manifest(path).checkpoint_id
    except CheckpointError:
        return None
