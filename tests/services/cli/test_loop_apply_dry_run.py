"""`ratchet loop apply --dry-run` of a new loop fails where the real apply would, with the
same words: the api makes every check of the creation and creates nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from services.db.models import Loop
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN
from tests.services.cli.support import run

UNKNOWN = (
    "ratchet: error: invalid loop: environment: 'chess' is not installed; known: replay, toolcalc\n"
)


def test_a_dry_run_refuses_an_unknown_environment_as_the_apply_does(
    api_url: str,
    tmp_path: Path,
    session_factory: SessionFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("name: games\nenvironment: chess\n")

    dry = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    real = run(capsys, "loop", "apply", "-f", str(path), "--show-secrets")
    assert dry == real == (1, "", UNKNOWN)
    with session_factory() as session:
        assert session.scalars(select(Loop)).all() == []

    path.write_text(
        "name: games\nenvironment: toolcalc\n"
        "serving_target: {kind: openai, endpoint: nowhere, model: games}\n"
    )
    dry = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    assert dry[0] == 1 and "'nowhere'" in dry[2]
    assert dry == run(capsys, "loop", "apply", "-f", str(path), "--show-secrets")

    path.write_text("name: games\nenvironment: toolcalc\n")
    code, out, _ = run(capsys, "loop", "apply", "-f", str(path), "--dry-run")
    assert code == 0 and out.endswith("loop games would be created (dry run)\n")
    with session_factory() as session:
        assert session.scalars(select(Loop)).all() == []


def test_the_api_dry_run_creates_nothing_and_refuses_a_taken_name(api_url: str) -> None:
    body = {"name": "taken", "environment": "toolcalc"}
    checked = httpx.post(f"{api_url}/v1/loops?dry_run=true", json=body, headers=ADMIN)
    assert checked.status_code == 200, checked.text
    assert checked.json() == {
        "name": "taken",
        "dry_run": True,
        "environment": "toolcalc",
        "executor": "local",
        "warnings": [],
    }
    assert httpx.get(f"{api_url}/v1/loops/taken", headers=ADMIN).status_code == 404
    created = httpx.post(f"{api_url}/v1/loops", json=body, headers=ADMIN, timeout=60)
    assert created.status_code == 201, created.text
    again = httpx.post(f"{api_url}/v1/loops?dry_run=true", json=body, headers=ADMIN)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "loop_exists"
