"""`ratchet checkpoint manifest|verify` and `ratchet models import` (with a real api for --loop)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory
from services.settings import Settings, get_settings
from services.training.checkpoint import read_manifest, verify_checkpoint
from tests.services.api.support import ADMIN_TOKEN, serve
from tests.services.cli.support import run
from tests.services.training.hf_support import build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's transformers model directory: no manifest, as save_pretrained leaves it."""
    path = tmp_path_factory.mktemp("user-model") / "model"
    build_tiny_llama(path)
    (path / "manifest.json").unlink()
    return path


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path / "state"))
    get_settings.cache_clear()
    yield tmp_path / "state"
    get_settings.cache_clear()


def test_manifest_then_verify(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "trained"
    shutil.copytree(model_dir, copy)
    code, out, _ = run(capsys, "checkpoint", "manifest", str(copy), "--json")
    assert code == 0
    manifest = json.loads(out)
    assert manifest["family"] == "hf" and manifest["kind"] == "full"
    assert set(manifest["files"]) == {p.name for p in model_dir.iterdir()}
    code, out, _ = run(capsys, "checkpoint", "verify", str(copy))
    assert code == 0 and out.startswith(f"ok: hf full checkpoint {manifest['checkpoint_id']}")
    (copy / "config.json").write_text("{}")
    code, _, err = run(capsys, "checkpoint", "verify", str(copy))
    assert code == 1 and "config.json" in err and "tampered" in err


@pytest.mark.parametrize(
    ("plant", "message"),
    [
        ("pickle", r"pytorch_model\.bin .*pickle"),
        ("symlink", "symlink"),
        ("subdir", "flat directory"),
        ("adapter", "LoRA adapter: pass --base"),
        ("no-weights", "no .safetensors weights"),
    ],
)
def test_manifest_refuses_what_a_checkpoint_cannot_hold(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], plant: str, message: str
) -> None:
    import re

    copy = tmp_path / "dir"
    shutil.copytree(model_dir, copy)
    if plant == "pickle":
        (copy / "pytorch_model.bin").write_bytes(b"\x80\x04")
    elif plant == "symlink":
        (copy / "environ").symlink_to("/proc/self/environ")
    elif plant == "subdir":
        (copy / "runs").mkdir()
    elif plant == "adapter":
        (copy / "adapter_config.json").write_text("{}")
    else:
        (copy / "model.safetensors").unlink()
    code, _, err = run(capsys, "checkpoint", "manifest", str(copy))
    assert code == 2
    assert err.startswith("ratchet: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (copy / "manifest.json").exists()


def test_import_copies_into_the_store_and_is_idempotent(
    model_dir: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "models", "import", str(model_dir), "--json")
    assert code == 0
    first = json.loads(out)
    target = Path(first["path"])
    assert target == state_dir / "artifacts" / "checkpoints" / first["checkpoint_id"]
    assert verify_checkpoint(target).checkpoint_id == first["checkpoint_id"]
    assert not (model_dir / "manifest.json").exists()  # the user's directory is left alone
    code, out, _ = run(capsys, "models", "import", str(model_dir), "--json")
    assert code == 0 and json.loads(out)["checkpoint_id"] == first["checkpoint_id"]
    code, _, err = run(capsys, "models", "import", str(state_dir / "nope"))
    assert code == 2 and "is not a directory" in err


def test_import_with_loop_makes_it_the_champion(
    model_dir: Path,
    state_dir: Path,
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN, state_dir=state_dir)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        monkeypatch.setenv("RATCHET_PUBLIC_URL", url)
        monkeypatch.setenv("RATCHET_ADMIN_TOKEN", ADMIN_TOKEN)
        get_settings.cache_clear()
        assert (
            run(capsys, "loop", "create", "agents", "--env", "toolcalc", "--show-secrets")[0] == 0
        )
        code, out, _ = run(capsys, "models", "import", str(model_dir), "--loop", "agents", "--json")
        assert code == 0, out
        result = json.loads(out)
        assert result["loop"] == "agents" and result["promotion_id"] is not None
        code, out, _ = run(capsys, "loop", "show", "agents", "--json")
        assert json.loads(out)["champion_checkpoint_id"] == result["checkpoint_id"]
        code, _, err = run(capsys, "models", "import", str(model_dir), "--loop", "missing")
        assert code == 1 and "no loop named 'missing'" in err
    assert read_manifest(Path(result["path"])).family == "hf"
