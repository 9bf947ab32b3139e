"""How a job learns the endpoints its replay tasks name: two job-contract variables.

A task names its judge (``verifier.params.reward.endpoint``) and its live tool endpoint
(``verifier.params.tool_endpoint``) by the names the deployment lists in
``settings.judge_endpoints`` and ``settings.tool_endpoints``; a job has no settings object,
so the worker that starts it passes the endpoints the loop names as

- ``RATCHET_JUDGE_ENDPOINTS``: ``{"name": {"url": ..., "api_key": ..., "timeout_s": ...}}``
- ``RATCHET_TOOL_ENDPOINTS``: ``{"name": {"kind": "http"|"mcp", "url" or "command", "tools":
  [allow-list], "api_key", "timeout_s", "requests_per_minute", "max_result_bytes"}}``
  (:class:`~.tool_endpoints.ToolEndpointConfig`),

the format of the settings themselves. :func:`job_env` builds them (worker side, from the
resolved settings), :func:`from_job_env` reads them (job side). Only named endpoints travel,
so a job never holds a key its loop does not use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from services.environments.replay.env import ReplayEnvironment
from services.environments.replay.judge import Judge, JudgeEndpoint
from services.environments.replay.tool_config import ToolEndpointConfig, ToolEndpointError
from services.environments.replay.tool_endpoints import LiveToolEndpoint

ENV_JUDGES = "RATCHET_JUDGE_ENDPOINTS"
ENV_TOOLS = "RATCHET_TOOL_ENDPOINTS"
JUDGE_REQUESTS_PER_MINUTE = 120.0


class EndpointConfigError(ValueError):
    """A job-contract endpoint variable that is not the documented JSON."""


def job_env(
    *,
    judges: Mapping[str, Mapping[str, Any]],
    tools: Mapping[str, Mapping[str, Any]],
    judge_names: Iterable[str] = (),
    tool_names: Iterable[str] = (),
) -> dict[str, str]:
    """The variables that hand a job the named endpoints (a judge as ``{"url", "api_key",
    "timeout_s"}``, a tool endpoint as :meth:`ToolEndpointConfig.to_json`; the key in clear:
    the executor keeps job env like any secret).
    A name the deployment does not list is a ValueError naming the known ones."""
    env: dict[str, str] = {}
    for variable, known, names in (
        (ENV_JUDGES, judges, judge_names),
        (ENV_TOOLS, tools, tool_names),
    ):
        chosen = {}
        for name in sorted(set(names)):
            if name not in known:
                listed = ", ".join(sorted(known)) or "none"
                raise ValueError(
                    f"endpoint {name!r} is not in the deployment's settings ({listed})"
                )
            chosen[name] = dict(known[name])
        if chosen:
            env[variable] = json.dumps(chosen, sort_keys=True)
    return env


def from_job_env(environ: Mapping[str, str] | None = None) -> ReplayEnvironment:
    """The replay environment with the endpoints the job was given (none when unset)."""
    environ = os.environ if environ is None else environ
    judges = {
        name: Judge(JudgeEndpoint(**config), requests_per_minute=JUDGE_REQUESTS_PER_MINUTE)
        for name, config in _parse(environ.get(ENV_JUDGES), ENV_JUDGES).items()
    }
    tools = {
        name: LiveToolEndpoint(config)
        for name, config in tool_endpoint_configs(environ.get(ENV_TOOLS)).items()
    }
    return ReplayEnvironment(judges=judges, live_tools=tools)


def tool_endpoint_configs(raw: str | None) -> dict[str, ToolEndpointConfig]:
    """``RATCHET_TOOL_ENDPOINTS`` parsed (none when unset); :class:`EndpointConfigError`
    names the endpoint and field at fault."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise EndpointConfigError(f"{ENV_TOOLS} is not valid JSON") from None
    if not isinstance(data, dict):
        raise EndpointConfigError(f"{ENV_TOOLS} must be an object of name -> endpoint")
    try:
        return {name: ToolEndpointConfig.from_json(name, config) for name, config in data.items()}
    except ToolEndpointError as exc:
        raise EndpointConfigError(f"{ENV_TOOLS}: {exc}") from None


def _parse(raw: str | None, variable: str) -> dict[str, dict[str, Any]]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise EndpointConfigError(f"{variable} is not valid JSON") from None
    if not isinstance(data, dict):
        raise EndpointConfigError(f"{variable} must be an object of name -> endpoint")
    out: dict[str, dict[str, Any]] = {}
    for name, config in data.items():
        if not isinstance(config, dict) or not isinstance(config.get("url"), str):
            raise EndpointConfigError(f"{variable}.{name} must be an object with a string url")
        unknown = sorted(set(config) - {"url", "api_key", "timeout_s"})
        if unknown:
            raise EndpointConfigError(f"{variable}.{name} has unknown field(s) {unknown}")
        timeout = _seconds(config.get("timeout_s", 30.0))
        if timeout is None:
            raise EndpointConfigError(f"{variable}.{name}.timeout_s must be a number > 0")
        key = config.get("api_key")
        if key is not None and not isinstance(key, str):
            raise EndpointConfigError(f"{variable}.{name}.api_key must be a string")
        out[name] = {"url": config["url"].rstrip("/"), "api_key": key, "timeout_s": timeout}
    return out


def _seconds(value: Any) -> float | None:
    """A positive number of seconds, also as text (settings accept ``"30"`` too)."""
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None
