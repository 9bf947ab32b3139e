"""Where a loop's calls go: the loop's serving endpoint under its served name, or the upstream
the loop names.

- A loop with a champion whose serving target has a server (``local``: the model server at
  ``RATCHET_SERVE_HOST:PORT``; ``openai``/``kubernetes``: the serving endpoint's URL) is
  served there, under the loop's served name (``serving_target.model``, default
  ``ratchet``): the name the serving target moves to each new champion.
- Before the first champion, a loop that names an upstream (``serving_target.upstream``, one
  of ``RATCHET_GATEWAY_UPSTREAMS``) is served by it with ``upstream_model``: a hosted model
  today, whose successful sessions a first champion is bootstrapped from.
- Otherwise the serving target's server answers under the served name (the base model a
  vLLM Deployment or ``ratchet serve`` was started with).

The request's own ``model`` is replaced: the key names the loop, and the loop names the
model. The agent never holds the upstream's key. Token ids and log-probs are asked of a
serving target (``ratchet serve`` and vLLM return them); a hosted upstream is asked only
for what the agent asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from services.loop.policies import RECORDED, ServingTarget
from services.serving.base import DEFAULT_MODEL, BuildContext
from services.serving.kinds import target_kind
from services.settings import Settings

SERVING = "serving"


@dataclass(frozen=True)
class Route:
    """One place a loop's calls go. ``base_url`` is the OpenAI base (ending in ``/v1``)."""

    name: str
    base_url: str
    api_key: str | None
    model: str
    token_ids: bool


@dataclass(frozen=True)
class NoRoute:
    """Why a loop's calls cannot go anywhere (a 503 that says what to configure)."""

    reason: str


def route_for(
    serving_target: Mapping[str, Any], *, has_champion: bool, settings: Settings
) -> Route | NoRoute:
    """See the module docstring."""
    try:
        policy = ServingTarget.model_validate(dict(serving_target), context=RECORDED)
    except ValidationError as exc:
        return NoRoute(f"the loop's serving target is invalid ({exc.error_count()} errors)")
    serving = _serving_route(policy, settings)
    if has_champion and isinstance(serving, Route):
        return serving
    if policy.upstream is not None:
        endpoint = settings.gateway_upstreams.get(policy.upstream)
        if endpoint is None:
            return NoRoute(
                f"the loop names upstream {policy.upstream!r}, which RATCHET_GATEWAY_UPSTREAMS "
                "does not list"
            )
        key = endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
        model = policy.upstream_model or DEFAULT_MODEL
        return Route(f"upstream:{policy.upstream}", endpoint.url, key, model, token_ids=False)
    return serving


def _serving_route(policy: ServingTarget, settings: Settings) -> Route | NoRoute:
    kind = target_kind(policy.kind)
    if kind is None:
        return NoRoute(f"serving target kind {policy.kind!r} is not known to this gateway")
    endpoint = settings.serving_endpoints.get(policy.endpoint or "")
    if kind.needs_endpoint and endpoint is None:
        return NoRoute(f"serving endpoint {policy.endpoint!r} is not configured on the gateway")
    address = kind.address(policy, BuildContext(settings=settings, endpoint=endpoint))
    if address is None:
        return NoRoute(
            "the loop serves nowhere the gateway can forward to: give it a serving target "
            "with a server, or an upstream (serving_target.upstream)"
        )
    base = address.url.rstrip("/")
    return Route(
        SERVING,
        base if base.endswith("/v1") else f"{base}/v1",
        address.api_key,
        policy.model or DEFAULT_MODEL,
        token_ids=True,
    )
