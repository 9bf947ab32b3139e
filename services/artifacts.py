"""Where artifacts live: datasets, job outputs, checkpoints, logs.

Locally the artifact root is a directory under the state dir; in a cluster it is a shared
volume mounted at the same path in the worker and in job pods, so a path written by one is
readable by the other. URIs are ``file://`` URIs of absolute paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


def path_to_uri(path: Path) -> str:
    return path.resolve().as_uri()


def uri_to_path(uri: str) -> Path:
    """The local path behind a ``file://`` URI (or a plain path)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"unsupported artifact URI scheme {parsed.scheme!r} in {uri!r}")


@dataclass(frozen=True)
class ArtifactStore:
    """Deterministic locations under one root; creating a location is idempotent."""

    root: Path

    def dataset_dir(self, loop: str, content_hash: str) -> Path:
        return self.root / "loops" / loop / "datasets" / content_hash

    def run_dir(self, loop: str, run_id: str) -> Path:
        return self.root / "loops" / loop / "runs" / run_id

    def checkpoint_dir(self, checkpoint_id: str) -> Path:
        return self.root / "checkpoints" / checkpoint_id

    def logs_dir(self, loop: str, run_id: str) -> Path:
        return self.run_dir(loop, run_id) / "logs"

    def ensure(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path
