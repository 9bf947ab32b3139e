"""Installing checkpoints into the content-addressed store.

A job writes its checkpoint into its own output dir; before anything trusts it, it is
verified (every file's sha256 against the manifest), copied atomically to
``checkpoints/<id>`` and verified again there. Used by the worker when a training run
finishes and by the api when an operator registers a first champion.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore, path_to_uri
from services.db.models import Checkpoint
from services.db.queries.runs import upsert_checkpoint


@dataclass(frozen=True)
class InstalledCheckpoint:
    """A verified checkpoint in the store, ready to be recorded."""

    checkpoint_id: str
    parent: str | None
    target: Path
    fmt: str
    manifest: dict[str, Any]
    size_bytes: int


def install_checkpoint(source: Path, store: ArtifactStore) -> InstalledCheckpoint:
    """Verify ``source`` and copy it into the store; raises ``CheckpointError`` if invalid."""
    # Imported here: the checkpoint format module pulls in torch, which callers need only
    # when they actually install a checkpoint.
    from services.training.checkpoint import verify_checkpoint

    manifest = verify_checkpoint(source)
    checkpoint_id = manifest.checkpoint_id
    target = store.checkpoint_dir(checkpoint_id)
    copy_atomically(
        source, target, verify=lambda path: verify_checkpoint(path, expected_id=checkpoint_id)
    )
    return InstalledCheckpoint(
        checkpoint_id=checkpoint_id,
        parent=manifest.parent,
        target=target,
        fmt=manifest.format,
        manifest=manifest.to_dict(),
        size_bytes=sum(p.stat().st_size for p in target.iterdir() if p.is_file()),
    )


def record_checkpoint(
    *,
    session: Session,
    installed: InstalledCheckpoint,
    loop_id: int,
    parent_id: str | None,
    run_id: str | None,
) -> Checkpoint:
    """The checkpoint's row (inserted unless its content id exists); never commits."""
    return upsert_checkpoint(
        session=session,
        checkpoint_id=installed.checkpoint_id,
        loop_id=loop_id,
        uri=path_to_uri(installed.target),
        fmt=installed.fmt,
        size_bytes=installed.size_bytes,
        sha256=installed.checkpoint_id,
        manifest=installed.manifest,
        parent_id=parent_id,
        run_id=run_id,
    )


def copy_atomically(source: Path, target: Path, *, verify: Callable[[Path], Any]) -> None:
    """Copy ``source`` to ``target`` atomically (temp dir + rename); keep a valid target."""
    if target.is_dir():
        verify(target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging")
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(source, staging)
    verify(staging)
    try:
        staging.rename(target)
    except OSError:
        # Another registration installed it first; it must verify too.
        shutil.rmtree(staging, ignore_errors=True)
        verify(target)
