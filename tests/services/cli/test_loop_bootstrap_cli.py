"""`ratchet loop bootstrap` against a real api (uvicorn) and Postgres: it prints the traces
it saw, the successes it uses and the ones it leaves out with why; a refusal is one line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from services.db.models import Loop
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN
from tests.services.cli.support import run
from tests.services.curation.bootstrap_traces import POLICY, curate, failure, post, success
from tests.services.training.hf_support import build_tiny_llama


def _create(
    api_url: str, session_factory: SessionFactory, name: str, environment: str = "replay"
) -> int:
    response = httpx.post(
        f"{api_url}/v1/loops",
        headers=ADMIN,
        json={
            "name": name,
            "environment": environment,
            "training_profile": {"family": "hf"},
            "curation_policy": POLICY,
            "serving_target": {"model": name},  # each loop serves under a name of its own
        },
        timeout=30,
    )
    assert response.status_code == 201, response.text
    with session_factory() as session:
        return session.scalars(select(Loop.id).where(Loop.name == name)).one()


def test_a_dry_run_prints_what_it_learns_from(
    api_url: str,
    session_factory: SessionFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build_tiny_llama(tmp_path / "base")
    loop_id = _create(api_url, session_factory, "desk")
    post(session_factory, loop_id, [failure(n) for n in range(12)])
    curate(session_factory, loop_id)
    post(session_factory, loop_id, [success(n) for n in range(12)])
    curate(session_factory, loop_id)

    code, out, err = run(
        capsys, "loop", "bootstrap", "desk", "--base", str(tmp_path / "base"), "--dry-run"
    )

    assert code == 0, err
    assert "traces seen: 24" in out
    assert "successes: 12; failures: 12 (never used)" in out
    assert "successes used (train split):" in out and "successes left out:" in out
    assert "held-out tasks, through the gate" in out and "dry run: nothing started" in out
    code, out, _ = run(
        capsys, "loop", "bootstrap", "desk", "--base", str(tmp_path / "base"), "--dry-run", "--json"
    )
    answer = json.loads(out)
    assert answer["status"] == "dry_run" and answer["report"]["failures"] == 12


def test_refusals_are_one_line(
    api_url: str,
    session_factory: SessionFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "loop", "bootstrap", "ghost")
    assert code == 1 and "there is no loop named 'ghost'" in err
    _create(api_url, session_factory, "desk")
    code, _, err = run(capsys, "loop", "bootstrap", "desk")
    assert code == 1 and "names no base model" in err and "--base" in err
    assert len(err.strip().splitlines()) == 1
    _create(api_url, session_factory, "calc", environment="toolcalc")
    code, _, err = run(capsys, "loop", "bootstrap", "calc", "--base", "x")
    assert code == 1 and "only the replay environment keeps" in err

    build_tiny_llama(tmp_path / "base")
    _create(api_url, session_factory, "crowned")
    code, _, err = run(capsys, "loop", "set-champion", "crowned", str(tmp_path / "base"))
    assert code == 0, err
    code, _, err = run(capsys, "loop", "bootstrap", "crowned", "--base", str(tmp_path / "base"))
    assert code == 1 and "already has champion" in err and "--force" in err
    code, _, err = run(
        capsys, "loop", "bootstrap", "crowned", "--base", str(tmp_path / "base"), "--force"
    )
    assert code == 1 and "no successful train-split traces to learn from" in err
