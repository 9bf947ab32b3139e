"""`ratchet loop ...` against a real api (uvicorn) and a real database."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ratchet_client import TraceClient

from services.cli import main
from services.settings import get_settings
from tests.services.api.support import free_port, make_trace
from tests.services.cli.support import run


def test_create_list_show_rotate(api_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "loop",
        "create",
        "calc",
        "--env",
        "toolcalc",
        "--budget-usd",
        "12.5",
        "--json",
        "--show-secrets",
    )
    assert code == 0
    created: dict[str, Any] = json.loads(out)
    assert created["name"] == "calc"
    assert created["signing_secret"].startswith("whsec_")
    assert created["ingest_token"].startswith("rit_")
    assert created["budget_usd"] == 12.5

    # The secret works with the light client's signed post (what `ratchet demo` uses).
    with TraceClient(api_url, "calc", created["signing_secret"]) as client:
        result = client.post([make_trace("c1")])
    assert result.accepted == 1

    code, out, _ = run(capsys, "loop", "list")
    assert code == 0 and "calc" in out and "toolcalc" in out
    code, out, _ = run(capsys, "loop", "list", "--json")
    assert [loop["name"] for loop in json.loads(out)] == ["calc"]
    code, out, _ = run(capsys, "loop", "show", "calc")
    assert code == 0 and "traces       1" in out and "signing_secret" in out
    code, out, _ = run(capsys, "loop", "show", "calc", "--json")
    assert json.loads(out)["trace_count"] == 1

    code, out, _ = run(capsys, "loop", "rotate-secret", "calc", "--grace-seconds", "60", "--json")
    assert code == 0
    rotated = json.loads(out)
    assert rotated["secret"] != created["signing_secret"]
    assert rotated["previous_expires_at"] is not None
    # Both secrets work during the grace period.
    for secret in (created["signing_secret"], rotated["secret"]):
        with TraceClient(api_url, "calc", secret) as client:
            ok = client.post([make_trace()])
        assert ok.accepted == 1
    code, _, err = run(capsys, "loop", "create", "plain", "--env", "toolcalc", "--show-secrets")
    # Both would serve as 'ratchet' on the local model server (issue 43).
    assert code == 1 and "already serves under the model name 'ratchet'" in err
    code, out, _ = run(
        capsys, "loop", "create", "plain", "--env", "toolcalc", "--model", "plain", "--show-secrets"
    )
    assert code == 0 and "signing secret: whsec_" in out and "ingest token:   rit_" in out


def test_errors_are_one_clear_line(
    api_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run(capsys, "loop", "create", "dup", "--env", "toolcalc", "--show-secrets")[0] == 0

    code, _, err = run(capsys, "loop", "create", "dup", "--env", "toolcalc", "--show-secrets")
    assert code == 1 and err.strip() == (
        "ratchet: error: a loop named 'dup' already exists; choose another name"
    )
    code, _, err = run(capsys, "loop", "show", "ghost")
    assert code == 1 and "there is no loop named 'ghost'" in err
    code, _, err = run(capsys, "loop", "create", "Bad_Name", "--env", "toolcalc", "--show-secrets")
    assert code == 1 and "invalid loop: name:" in err
    assert len(err.strip().splitlines()) == 1

    monkeypatch.setenv("RATCHET_ADMIN_TOKEN", "wrong")
    get_settings.cache_clear()
    code, _, err = run(capsys, "loop", "list")
    assert code == 1 and "refused the admin token" in err

    monkeypatch.setenv("RATCHET_PUBLIC_URL", f"http://127.0.0.1:{free_port()}")
    get_settings.cache_clear()
    code, _, err = run(capsys, "loop", "list")
    assert code == 1 and "cannot reach the Ratchet api" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_arguments_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["loop", "create", "x", "--env", "e", "--budget-usd", "lots"],
        ["loop", "create", "x", "--env", "e", "--executor", "slurm"],
        ["loop", "rotate-secret", "x", "--grace-seconds", "-5"],
        ["loop", "history", "x", "--limit", "0"],
        ["loop", "create", "x"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
