"""The serving target kinds by name: what a loop's ``serving_target.kind`` may say.

Adding a serving target is one new module plus one entry here:

1. ``services/serving/<kind>.py``: the target (the four verbs of
   :class:`~services.serving.base.ServingTarget`, a deploy verified by asking the server)
   and a ``build(config, context)`` that makes it from the loop's configuration and the
   worker's :class:`BuildContext`;
2. ``register(TargetKind("<kind>", _build_<kind>, ...))`` below, the builder a two-line
   function that imports the module when a target of that kind is first built.

The loop's configuration (:class:`services.loop.policies.ServingTarget`) accepts every
registered kind and asks its entry which fields it needs (``needs_endpoint``,
``needs_model``); :class:`services.serving.targets.ServingTargets` builds, attests, reads
usage and proves delivery through the entry, with no per-kind branch. This module imports
no target at load time: the api validates kinds without loading Kubernetes or HTTP clients.

A kind that deploys to one of the operator's serving endpoints (``needs_endpoint``) takes
its URL, key and timeouts from ``RATCHET_SERVING_ENDPOINTS``; an endpoint lists its kind
there too (``services.settings.ServingEndpoint.kind``), so a new endpoint kind is also a
value of that field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.serving.base import BuildContext, ServerAddress, ServingTarget

if TYPE_CHECKING:
    from services.loop.policies import ServingTarget as ServingConfig

Builder = Callable[["ServingConfig", BuildContext], ServingTarget]
AddressOf = Callable[["ServingConfig", BuildContext], "ServerAddress | None"]


@dataclass(frozen=True)
class TargetKind:
    """One kind of serving target.

    ``build``: None for a kind that serves nowhere (``none``: the champion is promoted
    offline). ``needs_endpoint``/``needs_model``: what a loop naming the kind must set.
    ``server``: where its model server answers for the serving ledger (a kind with an
    endpoint answers at the endpoint's URL; None: nothing to read). ``attests``: whether the
    server holds this worker's attestation key without the operator saying so (the local
    server this worker starts does; an endpoint does when marked ``attests``)."""

    name: str
    build: Builder | None
    needs_endpoint: bool = False
    needs_model: bool = False
    server: AddressOf | None = None
    attests: bool = False
    description: str = ""

    def address(self, config: ServingConfig, context: BuildContext) -> ServerAddress | None:
        """Where this kind's model server answers, or None when it has none to read."""
        if self.server is not None:
            return self.server(config, context)
        endpoint = context.endpoint
        if self.needs_endpoint and endpoint is not None:
            key = endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
            return ServerAddress(endpoint.url, key, endpoint.timeout_s)
        return None


TARGET_KINDS: dict[str, TargetKind] = {}


def register(kind: TargetKind) -> TargetKind:
    """Add a kind; a name can be registered once (two meanings of one name is a bug)."""
    if kind.name in TARGET_KINDS:
        raise ValueError(f"serving target kind {kind.name!r} is registered already")
    TARGET_KINDS[kind.name] = kind
    return kind


def target_kind(name: str) -> TargetKind | None:
    return TARGET_KINDS.get(name)


def kind_names() -> str:
    """The registered kinds, for error messages."""
    return ", ".join(TARGET_KINDS)


def _build_local(config: ServingConfig, context: BuildContext) -> ServingTarget:
    from services.serving.local import build

    return build(config, context)


def _local_server(config: ServingConfig, context: BuildContext) -> ServerAddress:
    from services.serving.local import address

    return address(context.settings)


def _build_openai(config: ServingConfig, context: BuildContext) -> ServingTarget:
    from services.serving.openai_target import build

    return build(config, context)


def _build_kubernetes(config: ServingConfig, context: BuildContext) -> ServingTarget:
    from services.serving.kubernetes import build

    return build(config, context)


register(
    TargetKind(
        "local",
        _build_local,
        server=_local_server,
        attests=True,
        description="the model server this worker starts (RATCHET_SERVE_HOST:PORT)",
    )
)
register(
    TargetKind(
        "openai",
        _build_openai,
        needs_endpoint=True,
        needs_model=True,
        description="an OpenAI-compatible server with vLLM's adapter endpoints",
    )
)
register(
    TargetKind(
        "kubernetes",
        _build_kubernetes,
        needs_endpoint=True,
        description="a Kubernetes Deployment of model servers",
    )
)
register(TargetKind("none", None, description="no server: the champion is promoted offline"))
