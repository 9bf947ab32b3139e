"""Installing checkpoints into the content-addressed store, and registering them.

A job writes its checkpoint into its own output dir; before anything trusts it, it is
verified (every file's sha256 against the manifest), copied atomically to
``checkpoints/<id>`` and verified again there. Used by the worker when a training run
finishes and by the api when an operator registers a first champion.

Job output is untrusted: only the files the manifest lists are copied (plus the manifest),
each opened with ``O_NOFOLLOW`` after an ``lstat`` shows a regular file, so a planted
``x -> /proc/self/environ`` is refused instead of copying the worker's environment onto the
shared volume. A LoRA adapter is installed only when its base checkpoint is already in the
store (adapters are resolved against ``checkpoints/<base id>``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore, path_to_uri
from services.db.models import Checkpoint
from services.db.queries.runs import NewCheckpoint, get_checkpoint, get_run, upsert_checkpoint
from services.training.checkpoint_manifest import (
    MANIFEST_FILE,
    CheckpointError,
    open_regular_file,
    verify_checkpoint,
)


class CheckpointRefused(Exception):
    """A checkpoint that cannot be registered as asked; ``kind`` names why, for callers
    that report it by type (the activity's non-retryable ``ApplicationError``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


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
    manifest = verify_checkpoint(source)
    checkpoint_id = manifest.checkpoint_id
    if manifest.base is not None:
        base_dir = store.checkpoint_dir(manifest.base.checkpoint_id)
        if not base_dir.is_dir():
            raise CheckpointError(
                f"LoRA adapter {checkpoint_id[:12]}… needs its base checkpoint "
                f"{manifest.base.checkpoint_id[:12]}…, which is not in the store: import it first"
            )
        verify_checkpoint(base_dir, expected_id=manifest.base.checkpoint_id)
    target = store.checkpoint_dir(checkpoint_id)
    copy_atomically(
        source,
        target,
        files=[*sorted(manifest.files), MANIFEST_FILE],
        verify=lambda path: verify_checkpoint(path, expected_id=checkpoint_id),
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
    checkpoint = NewCheckpoint(
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
    return upsert_checkpoint(session=session, checkpoint=checkpoint)


def resolve_parent(from_manifest: str | None, from_input: str | None) -> str | None:
    """The checkpoint's parent: the manifest's and the run's base must agree when both say."""
    if from_manifest and from_input and from_manifest != from_input:
        raise CheckpointRefused(
            "CheckpointLineageMismatch",
            f"the checkpoint's manifest names parent {from_manifest[:12]} but the run was "
            f"based on {from_input[:12]}",
        )
    return from_manifest or from_input


def register_run_checkpoint(
    *, session: Session, installed: InstalledCheckpoint, run_id: str
) -> Checkpoint:
    """Record a run's installed checkpoint under the run's loop; never commits.

    The run must exist, and so must the parent: lineage is a chain of registered rows, so
    a base checkpoint is registered before anything trained from it.
    """
    run = get_run(session=session, run_id=run_id)
    if run is None:
        raise CheckpointRefused("UnknownRun", f"run {run_id!r} does not exist")
    parent = installed.parent
    if parent is not None and not get_checkpoint(session=session, checkpoint_id=parent):
        raise CheckpointRefused(
            "UnknownParentCheckpoint",
            f"parent checkpoint {parent[:12]} of {installed.checkpoint_id[:12]} is not "
            "registered; register the base checkpoint first",
        )
    return record_checkpoint(
        session=session, installed=installed, loop_id=run.loop_id, parent_id=parent, run_id=run_id
    )


def copy_atomically(
    source: Path, target: Path, *, files: Sequence[str], verify: Callable[[Path], Any]
) -> None:
    """Copy the named regular ``files`` of ``source`` to ``target`` atomically (temp dir +
    rename), never through a symlink; keep a valid existing target."""
    if target.is_dir():
        verify(target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        for name in files:
            _copy_regular_file(source, staging, name)
        _fsync_directory(staging)
        verify(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(target)
    except OSError:
        # Another registration installed it first; it must verify too.
        shutil.rmtree(staging, ignore_errors=True)
        verify(target)
        return
    _fsync_directory(target.parent)  # the rename is durable before the row is recorded


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_regular_file(source: Path, staging: Path, name: str) -> None:
    if Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"refusing to copy {name!r}: not a plain file name")
    fd = open_regular_file(source / name)
    with os.fdopen(fd, "rb") as src, (staging / name).open("xb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
