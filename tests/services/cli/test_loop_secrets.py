"""`ratchet loop create`/`apply` print a new loop's secrets only when asked: --secret-file
PATH writes them to a new 0600 file, --show-secrets prints them; neither is refused before
anything is created (the secrets are shown once)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from ratchet_client import TraceClient
from sqlalchemy import select

from services.db.models import Loop
from services.db.session import SessionFactory
from tests.services.api.support import make_trace
from tests.services.cli.support import run


def test_create_without_a_way_to_keep_the_secrets_is_refused_before_creating(
    api_url: str, capsys: pytest.CaptureFixture[str], session_factory: SessionFactory
) -> None:
    code, out, err = run(capsys, "loop", "create", "calc", "--env", "toolcalc")
    assert code == 2
    assert "--secret-file" in err and "--show-secrets" in err
    assert "whsec_" not in out + err
    with session_factory() as session:
        assert session.scalars(select(Loop)).all() == []


def test_create_writes_the_secrets_to_a_private_file_and_not_to_stdout(
    api_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "calc.secrets.json"
    code, out, err = run(
        capsys, "loop", "create", "calc", "--env", "toolcalc", "--secret-file", str(path)
    )
    assert code == 0, err
    assert "whsec_" not in out and "rit_" not in out
    assert str(path) in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secrets = json.loads(path.read_text())
    assert secrets["loop"] == "calc"
    assert secrets["ingest_token"].startswith("rit_")
    with TraceClient(api_url, "calc", secrets["signing_secret"]) as client:
        result = client.post([make_trace()])
    assert result.accepted == 1
    # --json without --show-secrets leaves them out of stdout too.
    other = tmp_path / "other.json"
    code, out, _ = run(
        capsys,
        "loop",
        "create",
        "other",
        "--env",
        "toolcalc",
        "--model",
        "other",
        "--json",
        "--secret-file",
        str(other),
    )
    assert code == 0
    shown = json.loads(out)
    assert "signing_secret" not in shown and "ingest_token" not in shown
    assert shown["secret_file"] == str(other)


def test_an_existing_secret_file_is_refused_before_creating(
    api_url: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    session_factory: SessionFactory,
) -> None:
    path = tmp_path / "taken.json"
    path.write_text("{}")
    code, _, err = run(
        capsys, "loop", "create", "calc", "--env", "toolcalc", "--secret-file", str(path)
    )
    assert code == 2 and "exists" in err
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "nowhere.json")  # a dangling link is not written through
    code, _, err = run(
        capsys, "loop", "create", "calc", "--env", "toolcalc", "--secret-file", str(link)
    )
    assert code == 2 and "exists" in err
    assert not (tmp_path / "nowhere.json").exists()
    with session_factory() as session:
        assert session.scalars(select(Loop)).all() == []


def test_show_secrets_prints_them_as_before(
    api_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "loop", "create", "calc", "--env", "toolcalc", "--show-secrets")
    assert code == 0
    assert "signing secret: whsec_" in out and "ingest token:   rit_" in out


def test_apply_creating_a_loop_asks_the_same(
    api_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    loop_file = tmp_path / "loop.yaml"
    loop_file.write_text("schema: ratchet.loop/v1\nname: filed\nenvironment: toolcalc\n")
    code, _, err = run(capsys, "loop", "apply", "-f", str(loop_file))
    assert code == 2 and "--secret-file" in err
    secrets = tmp_path / "filed.json"
    code, out, _ = run(capsys, "loop", "apply", "-f", str(loop_file), "--secret-file", str(secrets))
    assert code == 0 and "whsec_" not in out
    assert json.loads(secrets.read_text())["signing_secret"].startswith("whsec_")
    # Changing an existing loop shows no secret and needs neither option.
    loop_file.write_text(loop_file.read_text() + "budget_usd: 5\n")
    code, out, _ = run(capsys, "loop", "apply", "-f", str(loop_file))
    assert code == 0 and "configured" in out
