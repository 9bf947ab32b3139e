"""Fixtures for executor tests: job specs under a temp artifact root, an emulated cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.executors.base import JobRequest
from tests.services.executors.kube_cluster import EmulatedCluster


@pytest.fixture
def make_spec(tmp_path: Path) -> Callable[..., JobRequest]:
    """A job spec for run ``run_id`` under ``tmp_path/artifacts`` (the artifact root)."""

    def make(run_id: str = "demo-c1-train", kind: str = "train", **overrides: Any) -> JobRequest:
        root = tmp_path / "artifacts"
        run_dir = root / "loops" / "demo" / "runs" / run_id
        job_kind = "train" if kind == "train" else "eval"
        document = {"schema": "ratchet.job/v1", "kind": job_kind, "run_id": run_id}
        document.update(overrides.pop("document", {}))
        fields: dict[str, Any] = {
            "run_id": run_id,
            "loop": "demo",
            "kind": kind,
            "document": document,
            "run_dir": run_dir,
            "output_dir": run_dir / "output",
            "logs_dir": run_dir / "logs",
            "cycle": 1,
        }
        fields.update(overrides)
        return JobRequest(**fields)

    return make


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as emulated:
        yield emulated
