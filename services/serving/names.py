"""One served name per loop: the model name a loop's agents call is that loop's alone.

A deploy loads the loop's checkpoint under its served name (``serving_target.model``, or
``ratchet`` when unset) and moves that name to it. Two loops serving on the same server
(the worker's local model server, or one serving endpoint) under the same name would each
deploy over the other: one loop's agents would be answered by the other's champion, and
each loop's canary would judge the other's model. So the name is checked where a loop is
saved (the api's 409) and again where it deploys (the worker refuses, non-retryably, a loop
saved before the check). Many loops on one endpoint, each under its own name, stay allowed:
that is how a deployment shares one server and one base model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from services.loop import policies
from services.serving.base import DEFAULT_MODEL
from services.serving.kinds import target_kind


def served_as(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(server, served name)`` a loop's serving target deploys to: the server is
    ``local`` (the worker's model server) or ``endpoint <name>``; None for a target that
    serves nowhere or does not parse (its deploy is refused for that)."""
    try:
        target = policies.ServingTarget.model_validate(dict(config), context=policies.RECORDED)
    except ValidationError:
        return None
    kind = target_kind(target.kind)
    if kind is None or kind.build is None:
        return None
    server = f"endpoint {target.endpoint}" if kind.needs_endpoint else target.kind
    return server, target.model or DEFAULT_MODEL


def loop_serving_the_same_name(
    config: Mapping[str, Any], others: Iterable[tuple[str, Mapping[str, Any]]]
) -> str | None:
    """The first of ``others`` (``(loop name, serving target)``, the loop itself left out)
    that serves under the same name on the same server, or None."""
    mine = served_as(config)
    if mine is None:
        return None
    return next((name for name, theirs in others if served_as(theirs) == mine), None)


def name_taken_message(config: Mapping[str, Any], other: str) -> str:
    """Why a loop may not serve as ``config`` says: loop ``other`` already does."""
    server, name = served_as(config) or ("", "")
    return (
        f"loop {other!r} already serves under the model name {name!r} on {server}: two loops "
        "under one name would each deploy over the other; set serving_target.model to a name "
        "of this loop's own"
    )
