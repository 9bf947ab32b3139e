"""A checkpoint installed into the store is on disk before it is recorded: every file, the
staged directory and the store's directory entry are fsynced (a power cut after the row is
committed must not leave a row pointing at a truncated or missing checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig


def test_install_fsyncs_the_files_and_the_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = GPTConfig(max_seq_len=16, n_layer=1, n_head=1, d_model=8, mlp_ratio=1)
    source = tmp_path / "champion"
    save_checkpoint(GPT(config), config, source)
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = ArtifactStore(tmp_path / "artifacts")
    installed = install_checkpoint(source, store)

    target = installed.target
    staging = target.with_name(f".{target.name}.staging")
    names = sorted(p.name for p in target.iterdir())
    assert {str(staging / name) for name in names} <= set(synced)
    assert str(staging) in synced  # the staged directory's entries, before the rename
    assert str(target.parent) in synced  # the rename itself
