"""Verifiable environments: the interface (``base``), the registry, toolcalc and replay (any
OpenAI-tools agent's traces)."""

from services.environments.base import (
    Environment,
    Episode,
    Rejection,
    Reward,
    TaskFileError,
    TaskSpec,
    read_task_file,
    write_task_file,
)
from services.environments.registry import environment_names, get_environment, register_environment

__all__ = [
    "Environment",
    "Episode",
    "Rejection",
    "Reward",
    "TaskFileError",
    "TaskSpec",
    "environment_names",
    "get_environment",
    "read_task_file",
    "register_environment",
    "write_task_file",
]
