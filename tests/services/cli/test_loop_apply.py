"""`ratchet loop apply -f` round trip against a real api and database: create, update,
dry-run diff, history, export, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from services.db.models import Loop, LoopConfigVersion
from services.db.session import SessionFactory
from tests.services.cli.support import run

LOOP_FILE = """\
schema: ratchet.loop/v1
name: support-bot
environment: toolcalc
budget_usd: 50
training_profile:
  algorithm: grpo
  hyperparameters: {steps: 40, lr: 0.001}
gate_policy:
  mode: manual
  confidence: 0.95
trigger_policy:
  min_new_tasks: 16
serving_target:
  kind: none
"""


def test_apply_round_trip(
    api_url: str,
    tmp_path: Path,
    session_factory: SessionFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text(LOOP_FILE)

    code, out, _ = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    assert code == 0, out
    assert '+ gate_policy.mode: "manual"' in out and "would be created" in out
    with session_factory() as session:
        assert session.scalars(select(Loop)).all() == []

    code, out, _ = run(capsys, "loop", "apply", "-f", str(path), "--by", "ana", "--show-secrets")
    assert code == 0, out
    assert "created" in out and "signing secret: whsec_" in out

    # Applying the same file again is a no-op: no new version.
    code, out, _ = run(capsys, "loop", "apply", "-f", str(path))
    assert (code, out.strip()) == (0, "loop support-bot unchanged (version 1)")

    # Edit the file: a stricter gate, a new trigger, no budget, the lr dropped (default).
    edited = (
        LOOP_FILE.replace("confidence: 0.95", "confidence: 0.99")
        .replace("min_new_tasks: 16", "min_new_tasks: 64")
        .replace("budget_usd: 50\n", "")
        .replace(", lr: 0.001", "")
    )
    path.write_text(edited)
    code, out, _ = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    assert code == 0, out
    assert out.splitlines() == [
        "- budget_usd: 50.0",
        "- gate_policy.confidence: 0.95",
        "+ gate_policy.confidence: 0.99",
        "- training_profile.hyperparameters.lr: 0.001",
        "- trigger_policy.min_new_tasks: 16",
        "+ trigger_policy.min_new_tasks: 64",
        "loop support-bot would change (dry run; still version 1)",
    ]
    with session_factory() as session:
        assert session.scalars(select(Loop)).one().gate_policy["confidence"] == 0.95

    code, out, _ = run(
        capsys, "loop", "apply", "-f", str(path), "--by", "bo", "--reason", "fewer false wins"
    )
    assert code == 0, out
    assert "configured: version 2" in out
    with session_factory() as session:
        loop = session.scalars(select(Loop)).one()
        assert loop.gate_policy == {"mode": "manual", "confidence": 0.99}
        assert loop.training_profile == {"algorithm": "grpo", "hyperparameters": {"steps": 40}}
        assert loop.budget_usd is None
        versions = session.scalars(
            select(LoopConfigVersion).order_by(LoopConfigVersion.version)
        ).all()
        assert [(v.version, v.changed_by) for v in versions] == [(1, "ana"), (2, "bo")]

    code, out, _ = run(capsys, "loop", "history", "support-bot", "--json")
    history = json.loads(out)
    assert [v["version"] for v in history] == [2, 1]
    assert history[0]["reason"] == "fewer false wins"
    assert {c["path"] for c in history[0]["changes"]} == {
        "budget_usd",
        "gate_policy.confidence",
        "training_profile.hyperparameters.lr",
        "trigger_policy.min_new_tasks",
    }
    code, out, _ = run(capsys, "loop", "history", "support-bot")
    assert "version 2" in out and "by bo (fewer false wins)" in out
    code, out, _ = run(capsys, "loop", "show", "support-bot")
    assert "config       version 2" in out

    # Export gives a file that applies as a no-op.
    code, out, _ = run(capsys, "loop", "export", "support-bot")
    assert code == 0
    exported = tmp_path / "exported.yaml"
    exported.write_text(out)
    code, out, _ = run(capsys, "loop", "apply", "-f", str(exported))
    assert (code, out.strip()) == (0, "loop support-bot unchanged (version 2)")


def test_apply_refuses_bad_files_and_invalid_values(
    api_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "loop.yaml"
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 2 and "cannot read" in err
    path.write_text("name: [unclosed")
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 2 and "not valid YAML" in err
    path.write_text("name: x\nenvironment: toolcalc\ngate: {}\n")
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 2 and "unknown key(s) gate" in err
    path.write_text("environment: toolcalc\n")
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 2 and "'name' is required" in err

    path.write_text(LOOP_FILE.replace("confidence: 0.95", "confidence: 3"))
    code, _, err = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    assert code == 1 and "gate_policy.confidence" in err
    path.write_text(LOOP_FILE)
    assert run(capsys, "loop", "apply", "-f", str(path), "--show-secrets")[0] == 0
    path.write_text(LOOP_FILE.replace("min_new_tasks: 16", "min_new_tasks: 0"))
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 1 and "invalid loop: trigger_policy.min_new_tasks" in err
    path.write_text(LOOP_FILE.replace("environment: toolcalc", "environment: chess"))
    code, _, err = run(capsys, "loop", "apply", "-f", str(path))
    assert code == 1 and "environment cannot change" in err
