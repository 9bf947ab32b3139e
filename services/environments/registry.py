"""Environments by name, so a task's ``environment`` field or a job spec can name one.

Three sources, looked up in this order: environments registered in-process with
:func:`register_environment`, the built-ins ``toolcalc`` and ``replay`` (any OpenAI-tools
agent's traces), and installed packages that
declare an entry point in the ``ratchet.environments`` group::

    # pyproject.toml of a team's own environment package
    [project.entry-points."ratchet.environments"]
    arith = "ratchet_arith:ArithEnvironment"

The entry point's name is the environment's name (what ``ratchet loop create --env``
takes) and its object is a zero-argument factory (usually the class). ``pip install`` of
such a package into the image that runs the api, the worker and the jobs is all it takes;
nothing in Ratchet lists it. Entry points are read once per process, lazily, with the
standard library's ``importlib.metadata``; a package that fails to import is reported with
its name and error when its environment is asked for, and never hides the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from services.environments.base import Environment

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ratchet.environments"
BUILTIN = frozenset({"replay", "toolcalc"})

_FACTORIES: dict[str, Callable[[], Environment]] = {}
_discovered: dict[str, EntryPoint] | None = None


def register_environment(name: str, factory: Callable[[], Environment]) -> None:
    """Make ``get_environment(name)`` build an environment with ``factory``."""
    if name in _FACTORIES:
        raise ValueError(f"environment {name!r} is already registered")
    _FACTORIES[name] = factory


def installed_entry_points() -> dict[str, EntryPoint]:
    """The ``ratchet.environments`` entry points of installed packages, by name.

    Two packages declaring the same name are ambiguous: the first one found wins and the
    clash is logged, naming both.
    """
    global _discovered
    if _discovered is None:
        found: dict[str, EntryPoint] = {}
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name in found and found[point.name].value != point.value:
                logger.warning(
                    "environment %r is declared twice (%s and %s); using the first",
                    point.name,
                    found[point.name].value,
                    point.value,
                )
                continue
            found.setdefault(point.name, point)
        _discovered = found
    return _discovered


def refresh_installed() -> None:
    """Forget the entry points read so far (after installing a package into this process)."""
    global _discovered
    _discovered = None


def environment_names() -> list[str]:
    """Every environment this process can build: registered, built in and installed."""
    return sorted(set(_FACTORIES) | BUILTIN | set(installed_entry_points()))


def get_environment(name: str) -> Environment:
    """A fresh environment instance; an unknown name is a ValueError listing the known ones."""
    return _factory(name)()


def _factory(name: str) -> Callable[[], Environment]:
    if name in _FACTORIES:
        return _FACTORIES[name]
    if name == "toolcalc":
        from services.environments.toolcalc import ToolcalcEnvironment

        return ToolcalcEnvironment
    if name == "replay":
        # A job's replay tasks may name judge and tool endpoints (job-contract variables).
        from services.environments.replay.endpoints import from_job_env

        return from_job_env
    point = installed_entry_points().get(name)
    if point is None:
        known = ", ".join(environment_names())
        raise ValueError(f"unknown environment {name!r} (known: {known})")
    try:
        factory = point.load()
    except Exception as exc:
        raise ValueError(
            f"environment {name!r} from entry point {point.value!r} cannot be loaded: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not callable(factory):
        raise ValueError(f"entry point {point.value!r} of environment {name!r} is not callable")
    return _checked(name, factory)


def _checked(name: str, factory: Callable[[], object]) -> Callable[[], Environment]:
    """The factory, wrapped so an object that is not an Environment is a clear error."""

    def build() -> Environment:
        env = factory()
        if not isinstance(env, Environment):
            raise ValueError(
                f"environment {name!r} does not implement the Environment interface "
                "(see docs/environments.md)"
            )
        return env

    return build
