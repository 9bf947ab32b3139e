"""Checkpoint format: round trip, content addressing, tamper detection, no pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from services.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    read_manifest,
    save_checkpoint,
    save_optimizer_state,
)
from services.training.tiny.model import GPT, GPTConfig, TinyModel

TINY = GPTConfig(max_seq_len=32, n_layer=1, n_head=2, d_model=16)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def test_round_trip(tmp_path: Path) -> None:
    model = tiny_model()
    manifest = save_checkpoint(model, TINY, tmp_path / "ckpt", metadata={"step": 3})
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["config.json", "manifest.json", "model.safetensors", "tokenizer.json"]
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.manifest == manifest == read_manifest(tmp_path / "ckpt")
    assert GPTConfig.from_dict(loaded.config) == TINY
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict[name], tensor)
    assert manifest.metadata == {"step": 3}
    assert set(manifest.files) == {"config.json", "model.safetensors", "tokenizer.json"}


def test_file_is_standard_safetensors(tmp_path: Path) -> None:
    model = tiny_model()
    save_checkpoint(model, TINY, tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as fh:
        keys = sorted(fh.keys())
        assert keys == sorted(model.state_dict())
        assert torch.equal(fh.get_tensor("head.weight"), model.head.weight.detach())


def test_content_addressed_id(tmp_path: Path) -> None:
    a = save_checkpoint(tiny_model(0), TINY, tmp_path / "a", metadata={"run": "x"})
    b = save_checkpoint(tiny_model(0), TINY, tmp_path / "b", parent="p" * 64, metadata={"run": "y"})
    c = save_checkpoint(tiny_model(1), TINY, tmp_path / "c")
    assert a.checkpoint_id == b.checkpoint_id != c.checkpoint_id
    assert b.parent == "p" * 64
    d = save_checkpoint(tiny_model(1), TINY, tmp_path / "d", parent=c)
    assert d.parent == c.checkpoint_id


def test_policy_load_verifies_and_generates(tmp_path: Path) -> None:
    manifest = save_checkpoint(tiny_model(), TINY, tmp_path / "ckpt")
    policy = TinyModel.load(tmp_path / "ckpt", device="cpu")
    assert policy.checkpoint_id == manifest.checkpoint_id
    out = policy.generate(["ab", "abc"], max_new_tokens=4, temperature=1.0, seed=1)
    assert len(out) == 2
    assert out == policy.generate(["ab", "abc"], max_new_tokens=4, temperature=1.0, seed=1)


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "tokenizer.json"])
def test_tampered_file_is_refused(tmp_path: Path, victim: str) -> None:
    save_checkpoint(tiny_model(), TINY, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / victim
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim} .*tampered or corrupt"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError):
        TinyModel.load(tmp_path / "ckpt", device="cpu")


def test_tampered_manifest_id_and_missing_files(tmp_path: Path) -> None:
    save_checkpoint(tiny_model(), TINY, tmp_path / "ckpt")
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    data = json.loads(manifest_path.read_text())
    data["checkpoint_id"] = "0" * 64
    manifest_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="does not match its files"):
        load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_expected_id_and_non_empty_target(tmp_path: Path) -> None:
    manifest = save_checkpoint(tiny_model(), TINY, tmp_path / "ckpt")
    assert (
        load_checkpoint(tmp_path / "ckpt", expected_id=manifest.checkpoint_id).manifest == manifest
    )
    with pytest.raises(CheckpointError, match="expected"):
        load_checkpoint(tmp_path / "ckpt", expected_id="f" * 64)
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(tiny_model(), TINY, tmp_path / "ckpt")


def test_optimizer_state_round_trip(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    save_optimizer_state(optimizer, tmp_path / "opt.safetensors")
    restored = torch.optim.AdamW(model.parameters(), lr=5.0)
    load_optimizer_state(restored, tmp_path / "opt.safetensors")
    original, again = optimizer.state_dict(), restored.state_dict()
    assert again["param_groups"] == original["param_groups"]
    for index, slot in original["state"].items():
        for key, value in slot.items():
            assert torch.equal(torch.as_tensor(again["state"][index][key]), torch.as_tensor(value))
