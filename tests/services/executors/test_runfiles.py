"""Run files are read and created without following a link a job planted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from services.executors.runfiles import (
    UnsafeRunFile,
    create_exclusive,
    open_for_reading,
    read_text,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "artifacts"
    (path / "runs" / "r1" / "logs").mkdir(parents=True)
    return path


def test_a_regular_file_is_read_and_a_new_one_created(root: Path) -> None:
    log = root / "runs" / "r1" / "logs" / "job.log"
    with os.fdopen(create_exclusive(root, log), "w") as fh:
        fh.write("hello\n")
    assert read_text(root, log) == "hello\n"
    with pytest.raises(FileExistsError):
        create_exclusive(root, log)


def test_missing_directories_are_made(root: Path) -> None:
    log = root / "runs" / "r2" / "logs" / "job.log"
    os.close(create_exclusive(root, log))
    assert log.is_file()


def test_a_dangling_link_is_never_created_through(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    log = root / "runs" / "r1" / "logs" / "job.log"
    os.symlink(target, log)
    with pytest.raises(FileExistsError):
        create_exclusive(root, log)
    assert not target.exists()


def test_a_linked_directory_on_the_way_is_refused(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "job.log").write_text("not mine\n")
    os.symlink(elsewhere, root / "runs" / "r3")
    with pytest.raises(UnsafeRunFile, match="symbolic link"):
        create_exclusive(root, root / "runs" / "r3" / "new.log")
    with pytest.raises(UnsafeRunFile, match="symbolic link"):
        open_for_reading(root, root / "runs" / "r3" / "job.log")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["job.log"]


def test_a_link_to_a_file_is_not_read(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.key"
    secret.write_text("key")
    log = root / "runs" / "r1" / "logs" / "job.log"
    os.symlink(secret, log)
    with pytest.raises(UnsafeRunFile, match="symbolic link"):
        read_text(root, log)


@pytest.mark.parametrize("path", ["/etc/passwd", "runs/../../x"])
def test_paths_outside_the_root_are_refused(root: Path, path: str) -> None:
    target = Path(path) if path.startswith("/") else root / path
    with pytest.raises(UnsafeRunFile):
        open_for_reading(root, target)


def test_the_spec_and_state_files_are_not_written_through_a_planted_link(
    tmp_path: Path, make_spec: Any
) -> None:
    """An earlier pod of the run left links under the names the worker writes next."""
    from services.executors.base import write_spec_file
    from services.executors.supervise import write_json_atomic

    spec = make_spec()
    spec.run_dir.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.symlink(victim, spec.run_dir / f".spec.json.{os.getpid()}.tmp")
    write_spec_file(spec)
    state = spec.run_dir / "executor"
    state.mkdir()
    os.symlink(victim, state / f".exit.json.{os.getpid()}.tmp")
    write_json_atomic(state / "exit.json", {"returncode": 0})
    assert victim.read_text() == "keep me\n"
    assert json.loads(spec.spec_path.read_text())["run_id"] == spec.run_id
