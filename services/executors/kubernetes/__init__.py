"""Jobs on Kubernetes: the job template, a pure Job builder, and the launcher that talks to
the API server. See docs/executors.md."""

from services.executors.kubernetes.builder import build_headless_service, build_job, job_name
from services.executors.kubernetes.launcher import KubernetesExecutor
from services.executors.kubernetes.template import JobTemplate, JobTemplateError, load_template

__all__ = [
    "JobTemplate",
    "JobTemplateError",
    "KubernetesExecutor",
    "build_headless_service",
    "build_job",
    "job_name",
    "load_template",
]
