"""What a local job gets of the worker: its environment (an allow-list), its threads, and
what the local executor refuses of a loop's own job (a command it may not run, an image it
ignores). Split from :mod:`services.executors.local`, which starts the jobs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.cores import ThreadBudget, job_threads, thread_budget, thread_env
from services.executors.base import JobRequest

# What a local job keeps of the worker's environment: how to find programs, libraries and
# accelerators, the locale, thread counts and model caches. An allow-list, not a deny-list:
# the worker's environment holds Ratchet's settings (RATCHET_DATABASE_URL, _ADMIN_TOKEN,
# _SECRET_KEY, _SERVE_API_KEY, ...), and may hold a cloud's or a model hub's credentials,
# none of which a job needs: it talks to nothing but its files (the job contract).
JOB_ENV_NAMES: frozenset[str] = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "PYTORCH_CUDA_ALLOC_CONF",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "XDG_CACHE_HOME",
        "TORCH_HOME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)
JOB_ENV_PREFIXES: tuple[str, ...] = ("LC_",)

LOOP_COMMAND_REFUSED = (
    "the local executor runs a loop's own job command only where the deployment enables "
    "it: set RATCHET_LOCAL_JOB_COMMANDS_ENABLED=true (settings field "
    "local_job_commands_enabled), trusting every author of a loop's configuration, as the "
    "command runs as the worker's user on the worker's machine (docs/deploy.md, Security); "
    "or use the kubernetes executor"
)


def job_environment(worker_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the worker's environment a local job gets (see :data:`JOB_ENV_NAMES`);
    the executor adds the job contract's variables."""
    return {
        key: value
        for key, value in worker_env.items()
        if key in JOB_ENV_NAMES or key.startswith(JOB_ENV_PREFIXES)
    }


def job_thread_env(spec: JobRequest, budget: ThreadBudget | None = None) -> dict[str, str]:
    """The loop's ``env`` for the job, with the thread variables set to the job's threads:
    its ``hyperparameters.threads`` where set (over the loop's env too: the job sets torch
    to it), else the loop's env where it names them, else the job's share of the machine
    (``ThreadBudget.job``: the model server beside it keeps the other half)."""
    budget = budget or thread_budget()
    hyperparameters = spec.document.get("hyperparameters")
    own = job_threads(hyperparameters) if isinstance(hyperparameters, Mapping) else None
    env = {**thread_env(budget.job), **spec.env}
    if own is not None:
        env.update(thread_env(own))
    return env


def image_ignored(image: str) -> str:
    return (
        f"the local executor ignores the job image {image!r}: the command runs on the "
        "worker's machine, not in a container"
    )


def check_loop_jobs(
    executor: str, training_profile: Mapping[str, Any], *, commands_enabled: bool
) -> tuple[list[tuple[str, str]], list[str]]:
    """What the local executor makes of a loop's ``train_job``/``eval_job``: the refusals
    (path, message) and the warnings, so a loop is refused when it is saved, not at its
    first job. Other executors run both the image and the command: nothing to say."""
    errors: list[tuple[str, str]] = []
    warnings: list[str] = []
    if executor != "local":
        return errors, warnings
    for key in ("train_job", "eval_job"):
        override = training_profile.get(key)
        if not isinstance(override, Mapping):
            continue
        path = f"training_profile.{key}"
        if override.get("command") and not commands_enabled:
            errors.append((f"{path}.command", LOOP_COMMAND_REFUSED))
        if override.get("image"):
            warnings.append(f"{path}.image: {image_ignored(str(override['image']))}")
    return errors, warnings
