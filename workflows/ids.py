"""Task-queue and workflow ids, and the run ids of a cycle's jobs: what the api, the worker
and every workflow name things by."""

from __future__ import annotations

DEFAULT_TASK_QUEUE = "ratchet"


def loop_workflow_id(loop: str) -> str:
    return f"loop/{loop}"


def cycle_workflow_id(loop: str, cycle: int, stage: str) -> str:
    """Child workflow ids derive from the cycle, so a retried parent never duplicates work."""
    return f"loop/{loop}/cycle/{cycle}/{stage}"


def run_id_for(loop: str, cycle: int, kind: str, suffix: str = "") -> str:
    """Deterministic run ids: the same cycle stage always names the same job."""
    base = f"{loop}-c{cycle}-{kind}"
    return f"{base}-{suffix}" if suffix else base


def uri_path(uri: str) -> str:
    """The filesystem path of a ``file://`` URI (job specs carry paths, payloads carry URIs)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri
