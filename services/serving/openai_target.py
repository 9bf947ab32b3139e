"""The ``openai`` serving target: any OpenAI-compatible server with vLLM's adapter endpoints.

vLLM (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), SGLang and ``ratchet serve`` all
qualify. The loop's agents call one name, the loop's *alias* (``model`` in the target's
configuration); every checkpoint is also served under a versioned name,
``<alias>-<first 12 hex of its id>``.

``deploy(checkpoint)``:

1. load the checkpoint under its versioned name (``POST /v1/load_lora_adapter``); the
   alias keeps serving the champion meanwhile;
2. move the alias to it (the same call with ``load_inplace``: the server switches the name
   between two requests, so no request fails);
3. verify by asking the server, never by trusting step 1's "ok": ``GET /v1/models`` must
   list both names loaded from the checkpoint's directory (``root``; and, on ``ratchet
   serve``, the checkpoint id), and a one-token probe to each name must be answered by it;
4. unload versioned names older than the previous one, so at most two versions stay
   resident (the previous one makes a rollback a move of the alias, not a load).

``rollback()`` moves the alias back to the previous version. Checkpoints reach the server by
path: the same artifact store mounted on both sides, with ``artifacts_dir`` saying where
the server sees the worker's artifact root when the mount points differ.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from services.artifacts import uri_to_path
from services.metrics import SERVING_SWAP_DURATION
from services.serving.base import (
    BuildContext,
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServedVersion,
    ServingUnavailable,
)
from services.serving.client import ModelCard, ModelServerClient, quoted

if TYPE_CHECKING:
    from services.loop.policies import ServingTarget as ServingConfig
    from services.settings import ServingEndpoint

logger = logging.getLogger(__name__)

Heartbeat = Callable[[str], None]
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KEEP_VERSIONS = 2  # the served one and the previous one


class OpenAIServingTarget:
    """Deploys checkpoints to one OpenAI-compatible server under one alias."""

    kind = "openai"

    def __init__(
        self,
        endpoint: ServingEndpoint,
        *,
        model: str,
        artifacts_root: Path | None = None,
        verify_timeout_s: float = 60.0,
        load_timeout_s: float = 600.0,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """``endpoint``: the deployment's serving endpoint, never a loop's: the server's URL,
        key and ``timeout_s`` (of each call but an adapter load, ``load_timeout_s``), and its
        ``artifacts_dir``: a checkpoint under ``artifacts_root`` here is loaded from the same
        place under that on the server."""
        self.model = model
        api_key = endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
        self._client = ModelServerClient(
            endpoint.url,
            api_key=api_key,
            timeout_s=endpoint.timeout_s,
            load_timeout_s=load_timeout_s,
        )
        self._artifacts_root = artifacts_root
        self._server_artifacts_dir = endpoint.artifacts_dir
        self._verify_timeout_s = verify_timeout_s
        self._heartbeat = heartbeat or (lambda _detail: None)
        self._previous: CheckpointRef | None = None

    @property
    def client(self) -> ModelServerClient:
        return self._client

    def close(self) -> None:
        self._client.close()

    def versioned_name(self, checkpoint_id: str) -> str:
        return f"{self.model}-{checkpoint_id[:12]}"

    def server_path(self, checkpoint: CheckpointRef) -> str:
        return server_path(checkpoint, self._artifacts_root, self._server_artifacts_dir)

    # ServingTarget -----------------------------------------------------------------------

    def current(self) -> ServedVersion | None:
        cards = self._client.models()
        alias = cards.get(self.model)
        if alias is None:
            return None
        version = version_of(alias)
        if version is None:
            return None
        previous = self._previous.id if self._previous is not None else None
        return ServedVersion(version=version, uri=alias.root, previous_version=previous)

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        started = time.perf_counter()
        path = self.server_path(checkpoint)
        versioned = self.versioned_name(checkpoint.id)
        cards = self._client.models()
        before = cards.get(self.model)
        before_version = version_of(before)
        changed = before is None or before.root != path or before_version != checkpoint.id
        existing = cards.get(versioned)
        if existing is None or existing.root != path:
            self._heartbeat(f"loading {versioned}")
            self._client.load(versioned, path, inplace=existing is not None)
        if changed:
            # The candidate proves itself under its own name before the alias moves to it.
            self._verify(checkpoint, path, (versioned,))
            self._heartbeat(f"moving {self.model} to {versioned}")
            self._client.load(self.model, path, inplace=before is not None)
        self._verify(checkpoint, path, (versioned, self.model))
        if changed and before is not None and before_version is not None:
            self._previous = CheckpointRef(id=before_version, uri=before.root or "")
        self._unload_old(keep={versioned, *self._previous_names()})
        latency_ms = (time.perf_counter() - started) * 1000.0
        SERVING_SWAP_DURATION.observe(latency_ms / 1000.0)
        logger.info("%s serves %s (%.0f ms)", self.model, checkpoint.id[:12], latency_ms)
        return DeployOutcome(
            version=checkpoint.id,
            previous_version=before_version,
            latency_ms=latency_ms,
            changed=changed,
            details={"model": self.model, "versioned_model": versioned, "root": path},
        )

    def rollback(self) -> DeployOutcome:
        if self._previous is None:
            raise DeployFailed(
                f"no previous version of {self.model!r} is known to this target; deploy the "
                "previous checkpoint instead"
            )
        previous = self._previous
        return self.deploy(CheckpointRef(id=previous.id, uri=Path(previous.uri).as_uri()))

    def stats(self) -> dict[str, Any]:
        cards = self._client.models()
        served = self.current()
        return {
            "model": self.model,
            "model_version": served.version if served else None,
            "resident": sorted(n for n in cards if n == self.model or n.startswith(self.model)),
        }

    # Steps -------------------------------------------------------------------------------

    def _verify(self, checkpoint: CheckpointRef, path: str, names: tuple[str, ...]) -> None:
        """The server's own word: ``names`` listed from ``path``, and each answers a probe."""
        problem = wait_until_served(
            self._client,
            names,
            path,
            checkpoint.id,
            timeout_s=self._verify_timeout_s,
            heartbeat=lambda: self._heartbeat(f"verifying {', '.join(names)}"),
        )
        if problem:
            raise DeployFailed(
                f"deploy of {checkpoint.id[:12]} as {self.model!r} not verified: {problem}"
            )

    def _previous_names(self) -> set[str]:
        return {self.versioned_name(self._previous.id)} if self._previous is not None else set()

    def _unload_old(self, *, keep: set[str]) -> None:
        """Unload this alias's versioned names other than ``keep`` (best effort)."""
        prefix = f"{self.model}-"
        try:
            cards = self._client.models()
        except ServingUnavailable:
            return
        for name in cards:
            if name not in keep and re.fullmatch(rf"{re.escape(prefix)}[0-9a-f]{{12}}", name):
                try:
                    self._client.unload(name)
                except (DeployFailed, ServingUnavailable) as exc:
                    logger.warning("could not unload %s: %s", name, exc)


def server_path(
    checkpoint: CheckpointRef, artifacts_root: Path | None, server_artifacts_dir: str | None
) -> str:
    """Where a model server reads ``checkpoint``: the same artifact store, mounted at
    ``server_artifacts_dir`` on the server when that is set."""
    path = uri_to_path(checkpoint.uri)
    if artifacts_root is None or server_artifacts_dir is None:
        return str(path)
    try:
        relative = path.resolve().relative_to(artifacts_root.resolve())
    except ValueError:
        return str(path)
    return str(PurePosixPath(server_artifacts_dir) / relative.as_posix())


def served_problem(
    client: ModelServerClient, names: tuple[str, ...], path: str, version: str
) -> str:
    """Why the server does not serve ``version`` from ``path`` under ``names`` ("" if it does).

    Asks ``/v1/models`` (each name listed, loaded from ``path``, and on ``ratchet serve``
    reporting ``version``) and probes each name with a one-token completion."""
    cards = client.models()
    for name in names:
        card = cards.get(name)
        if card is None:
            return f"/v1/models does not list {name!r}"
        if card.root != path:
            return f"{name!r} is served from {quoted(card.root)}, not {path!r}"
        if card.version is not None and card.version != version:
            return f"{name!r} serves {quoted(card.version[:12])}, not {version[:12]}"
        answer = client.probe(name)
        if answer.model != name:
            return f"a probe of {name!r} was answered by {quoted(answer.model)}"
        if answer.version is not None and answer.version != version:
            return f"a probe of {name!r} was answered by {quoted(answer.version[:12])}"
    return ""


def wait_until_served(
    client: ModelServerClient,
    names: tuple[str, ...],
    path: str,
    version: str,
    *,
    timeout_s: float,
    heartbeat: Callable[[], None],
    not_yet: tuple[type[Exception], ...] = (ServingUnavailable,),
) -> str:
    """Ask the server (:func:`served_problem`) every half second until it serves ``version``
    ("") or ``timeout_s`` has passed (the last problem). A ``not_yet`` error counts as a
    problem to wait out, any other is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        heartbeat()
        try:
            problem = served_problem(client, names, path, version)
        except not_yet as exc:
            problem = str(exc)
        if not problem or time.monotonic() > deadline:
            return problem
        time.sleep(0.5)


def version_of(card: ModelCard | None) -> str | None:
    """The checkpoint id behind a card: reported, or named by its content-addressed root."""
    if card is None:
        return None
    if card.version is not None:
        return card.version
    if card.root is not None:
        leaf = PurePosixPath(card.root).name
        if _HEX64.match(leaf):
            return leaf
    return None


def build(config: ServingConfig, context: BuildContext) -> OpenAIServingTarget:
    """The ``openai`` kind: the loop's endpoint (its URL, key and artifact mount come only
    from the operator's settings), serving the loop's alias."""
    endpoint = context.endpoint
    assert endpoint is not None and config.model is not None  # the kind requires both
    return OpenAIServingTarget(
        endpoint,
        model=config.model,
        artifacts_root=context.settings.artifacts_dir if endpoint.artifacts_dir else None,
        verify_timeout_s=config.verify_timeout_s,
        heartbeat=context.heartbeat,
    )
