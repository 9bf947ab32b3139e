"""``ratchet demo --model smollm2``'s champion is an adapter the model server can load.

The real SmolLM2 is converted in tests/services/training/test_smollm2.py and its SFT takes
tens of minutes on 2 cores, so here the tests' tiny random Llama stands in for it: the
wiring under test (base installed in the store, the adapter trained through the job
contract and served from the store) is the same for any hf base.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.artifacts import ArtifactStore
from services.demo import smollm2
from services.training.checkpoint import read_manifest, verify_checkpoint
from services.training.hf.checkpoint import resolve_base_dir
from tests.services.training.hf_support import build_tiny_llama


def test_the_champion_is_served_from_the_store_beside_its_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.training.hf.smollm2.smollm2_checkpoint", _tiny_base)
    monkeypatch.setattr(
        smollm2,
        "SFT_HYPERPARAMETERS",
        {"steps": 1, "batch_size": 2, "micro_batch": 2, "lr": 1e-3, "log_every": 0},
    )
    monkeypatch.setattr(smollm2, "SFT_TASKS", 4)
    artifacts = tmp_path / "artifacts"
    lines: list[str] = []

    champion = smollm2.make_champion(tmp_path / "cache", artifacts, lines.append)

    manifest = read_manifest(champion)
    assert manifest.kind == "lora" and manifest.base is not None
    assert champion == ArtifactStore(artifacts).checkpoint_dir(manifest.checkpoint_id)
    # What the model server does with an adapter whose base it does not hold yet.
    base = resolve_base_dir(champion, manifest, None)
    verify_checkpoint(base, expected_id=manifest.base.checkpoint_id)
    # A second demo reuses the adapter it made and serves the same checkpoint.
    assert smollm2.make_champion(tmp_path / "cache", artifacts, lines.append) == champion
    assert any("reusing the SmolLM2 champion" in line for line in lines)


def _tiny_base(model_dir: Path) -> None:
    """Made once and then kept, as the SmolLM2 conversion is cached."""
    if not (model_dir / "manifest.json").exists():
        build_tiny_llama(model_dir)
