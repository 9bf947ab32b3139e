"""Environments by name, so a task's ``environment`` field or a job spec can name one."""

from __future__ import annotations

from collections.abc import Callable

from services.environments.base import Environment

_FACTORIES: dict[str, Callable[[], Environment]] = {}


def register_environment(name: str, factory: Callable[[], Environment]) -> None:
    """Make ``get_environment(name)`` build an environment with ``factory``."""
    if name in _FACTORIES:
        raise ValueError(f"environment {name!r} is already registered")
    _FACTORIES[name] = factory


def environment_names() -> list[str]:
    _register_builtins()
    return sorted(_FACTORIES)


def get_environment(name: str) -> Environment:
    """A fresh environment instance; an unknown name is a ValueError listing the known ones."""
    _register_builtins()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        known = ", ".join(sorted(_FACTORIES)) or "none"
        raise ValueError(f"unknown environment {name!r} (known: {known})") from None
    return factory()


def _register_builtins() -> None:
    if "toolcalc" not in _FACTORIES:
        from services.environments.toolcalc import ToolcalcEnvironment

        _FACTORIES["toolcalc"] = ToolcalcEnvironment
