"""The serving target kinds by name: what a loop's ``serving_target.kind`` may say, and what
an endpoint's ``kind`` in ``RATCHET_SERVING_ENDPOINTS`` may say.

Adding a serving target is one new module plus one entry here:

1. ``services/serving/<kind>.py``: the target (the four verbs of
   :class:`~services.serving.base.ServingTarget`, a deploy verified by asking the server)
   and a ``build(config, context)`` that makes it from the loop's configuration and the
   worker's :class:`BuildContext`;
2. ``register(TargetKind("<kind>", _build_<kind>, ...))`` below, the builder a two-line
   function that imports the module when a target of that kind is first built. The entry
   says what a loop naming the kind must set (``needs_endpoint``, ``needs_model``) and, for
   a kind that deploys to one of the operator's serving endpoints, which endpoint fields
   that endpoint must set or must leave unset (``endpoint_requires``,
   ``endpoint_refuses``: names of :class:`services.settings.ServingEndpoint` fields).

Nothing else changes. The loop's configuration (:class:`services.loop.policies.ServingTarget`)
accepts every registered kind, asks its entry which fields it needs, and publishes one
branch per kind in the OpenAPI; :class:`services.serving.targets.ServingTargets` builds,
attests, reads usage and proves delivery through the entry, with no per-kind branch. The
settings take an endpoint's ``kind`` as a name only (they are the bottom layer and import
no serving code): :func:`check_serving_endpoints` holds every configured endpoint to its
kind's entry when the api and the worker start, and :func:`endpoint_problem` when a loop
naming one is saved or deployed. This module imports no target at load time: the api
validates kinds without loading Kubernetes or HTTP clients.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.serving.base import BuildContext, ServerAddress, ServingTarget
from services.settings import SERVING_KIND_NAME, ServingEndpoint, SettingsError

if TYPE_CHECKING:
    from services.loop.policies import ServingTarget as ServingConfig

Builder = Callable[["ServingConfig", BuildContext], ServingTarget]
AddressOf = Callable[["ServingConfig", BuildContext], "ServerAddress | None"]

ENDPOINTS_VARIABLE = "RATCHET_SERVING_ENDPOINTS"


@dataclass(frozen=True)
class TargetKind:
    """One kind of serving target.

    ``build``: None for a kind that serves nowhere (``none``: the champion is promoted
    offline). ``needs_endpoint``/``needs_model``: what a loop naming the kind must set.
    ``endpoint_requires``/``endpoint_refuses``: the :class:`ServingEndpoint` fields an
    endpoint of this kind must set / must leave unset (a ``kubernetes`` endpoint names the
    Deployment it patches; an ``openai`` one has no Deployment to name). ``server``: where
    its model server answers for the serving ledger (a kind with an endpoint answers at the
    endpoint's URL; None: nothing to read). ``attests``: whether the server holds this
    worker's attestation key without the operator saying so (the local server this worker
    starts does; an endpoint does when marked ``attests``)."""

    name: str
    build: Builder | None
    needs_endpoint: bool = False
    needs_model: bool = False
    endpoint_requires: tuple[str, ...] = ()
    endpoint_refuses: tuple[str, ...] = ()
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
    """Add a kind; a name can be registered once (two meanings of one name is a bug). The
    name must be one an endpoint can give as its kind, and the endpoint fields the entry
    names must be fields of an endpoint, so a typo fails here rather than never matching."""
    if kind.name in TARGET_KINDS:
        raise ValueError(f"serving target kind {kind.name!r} is registered already")
    if not re.fullmatch(SERVING_KIND_NAME, kind.name):
        raise ValueError(f"serving target kind {kind.name!r} must match {SERVING_KIND_NAME}")
    fields = (*kind.endpoint_requires, *kind.endpoint_refuses)
    if fields and not kind.needs_endpoint:
        raise ValueError(f"serving target kind {kind.name!r} sets endpoint rules but no endpoint")
    unknown = sorted(set(fields) - set(ServingEndpoint.model_fields))
    if unknown:
        raise ValueError(
            f"serving target kind {kind.name!r} names no serving endpoint field "
            f"{', '.join(unknown)}"
        )
    TARGET_KINDS[kind.name] = kind
    return kind


def target_kind(name: str) -> TargetKind | None:
    return TARGET_KINDS.get(name)


def kind_names() -> str:
    """The registered kinds, for error messages."""
    return ", ".join(TARGET_KINDS)


def endpoint_kind_names() -> str:
    """The registered kinds that deploy to a serving endpoint, for error messages."""
    return ", ".join(name for name, kind in TARGET_KINDS.items() if kind.needs_endpoint)


def endpoint_problem(name: str, endpoint: ServingEndpoint) -> str:
    """Why the serving endpoint ``name`` does not fit its kind's entry, or "": one line
    naming the variable, the endpoint and the field (never a value: entries hold keys)."""
    where = f"{ENDPOINTS_VARIABLE} ({name}"
    kind = target_kind(endpoint.kind)
    registered = f"registered endpoint kinds: {endpoint_kind_names()}"
    if kind is None:
        return f"{where}.kind): unknown serving endpoint kind {endpoint.kind!r}; {registered}"
    if not kind.needs_endpoint:
        return f"{where}.kind): {_a(kind.name)} serving target deploys to no endpoint; {registered}"
    for field in kind.endpoint_requires:
        if getattr(endpoint, field) is None:
            return f"{where}.{field}): {_a(kind.name)} serving endpoint needs `{field}`"
    for field in kind.endpoint_refuses:
        if getattr(endpoint, field) is not None:
            takers = " or ".join(
                other.name
                for other in TARGET_KINDS.values()
                if other.needs_endpoint and field not in other.endpoint_refuses
            )
            owner = f"; it belongs to {_a(takers)} serving endpoint" if takers else ""
            return f"{where}.{field}): {_a(kind.name)} serving endpoint takes no `{field}`{owner}"
    return ""


def endpoint_problems(endpoints: Mapping[str, ServingEndpoint]) -> list[str]:
    """What each configured endpoint gets wrong for its kind, one line per endpoint."""
    problems = (endpoint_problem(name, endpoint) for name, endpoint in endpoints.items())
    return [problem for problem in problems if problem]


def check_serving_endpoints(endpoints: Mapping[str, ServingEndpoint]) -> None:
    """Refuse to start (:class:`SettingsError`, the one line the CLI prints) with an endpoint
    its kind's entry refuses: the api and the worker call this when they start, so a bad
    entry stops the process instead of failing a request or a deploy later."""
    problems = endpoint_problems(endpoints)
    if problems:
        raise SettingsError("invalid setting " + "; ".join(problems))


def _a(word: str) -> str:
    return f"{'an' if word[:1] in set('aeiou') else 'a'} {word}"


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
        endpoint_refuses=("namespace", "deployment", "container"),
        description="an OpenAI-compatible server with vLLM's adapter endpoints",
    )
)
register(
    TargetKind(
        "kubernetes",
        _build_kubernetes,
        needs_endpoint=True,
        endpoint_requires=("deployment",),
        description="a Kubernetes Deployment of model servers",
    )
)
register(TargetKind("none", None, description="no server: the champion is promoted offline"))
