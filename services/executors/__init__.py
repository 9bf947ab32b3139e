"""Where jobs run: the Executor protocol and its implementations (local, kubernetes).

:func:`build_executor` is the one place an executor is made from settings; the Kubernetes
client is imported only when that executor is asked for.
"""

from __future__ import annotations

from services.executors.base import (
    CONFIG_EXIT_CODES,
    TERMINAL_STATES,
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    Handle,
    JobRejected,
    JobRequest,
    JobRequestError,
    JobState,
    JobStatus,
)
from services.settings import Settings

EXECUTOR_NAMES = ("local", "kubernetes")
# The local executor's job queue, under the artifact root (one per machine).
LOCAL_QUEUE_SUBDIR = "local-jobs"


def build_executor(name: str, settings: Settings) -> Executor:
    """The executor called ``name``, configured from ``settings``."""
    if name == "local":
        from services.executors.local import LocalExecutor

        return LocalExecutor(
            python=settings.job_python,
            loop_commands_enabled=settings.local_job_commands_enabled,
            max_running=settings.local_max_jobs or None,
            queue_dir=settings.artifacts_dir / LOCAL_QUEUE_SUBDIR,
        )
    if name == "kubernetes":
        from services.executors.kubernetes import KubernetesExecutor, load_template
        from services.executors.kubernetes.api import api_client_from_settings

        if settings.kubernetes_job_template is None:
            raise JobRequestError(
                "the kubernetes executor needs a job template: set "
                "RATCHET_KUBERNETES_JOB_TEMPLATE to a YAML or JSON file (see docs/executors.md)"
            )
        template = load_template(settings.kubernetes_job_template)
        return KubernetesExecutor(
            api_client_from_settings(settings),
            namespace=settings.kubernetes_namespace,
            template=template,
        )
    raise JobRequestError(f"unknown executor {name!r}; expected one of {', '.join(EXECUTOR_NAMES)}")


__all__ = [
    "CONFIG_EXIT_CODES",
    "EXECUTOR_NAMES",
    "TERMINAL_STATES",
    "Executor",
    "ExecutorError",
    "ExecutorUnavailable",
    "Handle",
    "JobRejected",
    "JobRequest",
    "JobRequestError",
    "JobState",
    "JobStatus",
    "build_executor",
]
