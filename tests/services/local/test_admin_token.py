"""The local stack's admin token: generated once (0600), reused, shown, found by the CLI."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.cli import main
from services.cli.common import admin_token_for_cli
from services.db.session import SessionFactory
from services.local.admin_token import (
    SERVE_ADMIN_KEY_FILE,
    SERVE_ATTESTATION_KEY_FILE,
    SERVE_KEY_FILE,
    AdminTokenError,
    ensure_local_admin_token,
    ensure_local_serve_api_key,
    is_loopback_url,
    read_local_admin_token,
    token_path,
)
from services.local.stack import (
    Stack,
    StackError,
    with_local_admin_token,
    with_local_serve_keys,
)
from services.settings import Settings, get_settings
from tests.services.api.support import serve


def test_generated_once_private_and_reused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    token = ensure_local_admin_token(state)
    assert len(token) >= 32
    assert stat.S_IMODE(token_path(state).stat().st_mode) == 0o600
    assert ensure_local_admin_token(state) == token
    assert read_local_admin_token(state) == token
    token_path(state).chmod(0o644)
    with pytest.raises(AdminTokenError, match="readable by other users"):
        ensure_local_admin_token(state)
    assert read_local_admin_token(tmp_path / "elsewhere") is None


def test_ratchet_up_uses_a_set_token_else_the_local_one(tmp_path: Path) -> None:
    explicit = Settings(state_dir=tmp_path / "a", admin_token=SecretStr("set-by-operator"))
    settings, generated = with_local_admin_token(explicit)
    assert generated is None and settings is explicit
    assert not token_path(tmp_path / "a").exists()

    settings, generated = with_local_admin_token(Settings(state_dir=tmp_path / "b"))
    assert generated is not None and settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == generated
    stack = Stack(settings, generated_admin_token=generated, database_url="postgresql://x/y")
    assert stack.child_environment()["RATCHET_ADMIN_TOKEN"] == generated
    assert f"Admin token       {generated}" in stack.banner()

    (tmp_path / "c").mkdir()
    token_path(tmp_path / "c").write_text("leaky\n")
    token_path(tmp_path / "c").chmod(0o644)
    with pytest.raises(StackError, match="readable by other users"):
        with_local_admin_token(Settings(state_dir=tmp_path / "c"))


def test_ratchet_up_makes_model_server_keys_of_their_own_for_the_worker(tmp_path: Path) -> None:
    """The local model server's key is generated like the admin token, is another secret,
    and reaches the worker through its environment (the worker hands it to the model
    server it starts the same way, never on a command line)."""
    state = tmp_path / "state"
    settings, token = with_local_admin_token(Settings(state_dir=state))
    settings = with_local_serve_keys(settings)
    assert settings.serve_api_key is not None
    key = settings.serve_api_key.get_secret_value()
    assert len(key) >= 32 and key != token
    assert stat.S_IMODE((state / SERVE_KEY_FILE).stat().st_mode) == 0o600
    assert ensure_local_serve_api_key(state) == key  # reused
    assert settings.serve_attestation_key is not None
    attesting = settings.serve_attestation_key.get_secret_value()
    assert len(attesting) >= 32 and attesting not in (key, token)
    assert stat.S_IMODE((state / SERVE_ATTESTATION_KEY_FILE).stat().st_mode) == 0o600
    assert settings.serve_admin_key is not None  # loads models: the worker's, not the agents'
    admin = settings.serve_admin_key.get_secret_value()
    assert len(admin) >= 32 and admin not in (key, token, attesting)
    assert stat.S_IMODE((state / SERVE_ADMIN_KEY_FILE).stat().st_mode) == 0o600
    environment = Stack(settings, database_url="postgresql://x/y").child_environment()
    assert environment["RATCHET_SERVE_API_KEY"] == key
    assert environment["RATCHET_SERVE_ADMIN_KEY"] == admin
    assert environment["RATCHET_SERVE_ATTESTATION_KEY"] == attesting
    # api and worker run one torch thread each; the servers and jobs get their shares.
    assert environment["OMP_NUM_THREADS"] == environment["MKL_NUM_THREADS"] == "1"

    explicit = Settings(
        state_dir=tmp_path / "set",
        serve_api_key=SecretStr("operator-key"),
        serve_admin_key=SecretStr("operator-admin-key"),
        serve_attestation_key=SecretStr("operator-attestation-key"),
    )
    assert with_local_serve_keys(explicit) is explicit
    assert not (tmp_path / "set" / SERVE_KEY_FILE).exists()
    assert not (tmp_path / "set" / SERVE_ADMIN_KEY_FILE).exists()
    assert not (tmp_path / "set" / SERVE_ATTESTATION_KEY_FILE).exists()

    (state / SERVE_KEY_FILE).chmod(0o644)
    with pytest.raises(StackError, match="readable by other users"):
        with_local_serve_keys(Settings(state_dir=state))


def test_the_cli_sends_the_local_token_only_to_this_machine(tmp_path: Path) -> None:
    token = ensure_local_admin_token(tmp_path)
    local = Settings(state_dir=tmp_path, public_url="http://127.0.0.1:8000")
    assert admin_token_for_cli(local) == token
    remote = Settings(state_dir=tmp_path, public_url="https://ratchet.example.com")
    assert admin_token_for_cli(remote) is None
    explicit = Settings(state_dir=tmp_path, admin_token=SecretStr("mine"))
    assert admin_token_for_cli(explicit) == "mine"
    assert is_loopback_url("http://localhost:1") and is_loopback_url("http://[::1]:8000")
    assert not is_loopback_url("http://10.0.0.1:8000")


@pytest.fixture
def local_api(
    tmp_path: Path,
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Path]:
    """An api started with the state dir's token; the CLI's environment has no token."""
    state = tmp_path / "state"
    token = ensure_local_admin_token(state)
    settings = Settings(database_url=database_url, admin_token=SecretStr(token))
    app_state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=app_state)) as url:
        monkeypatch.delenv("RATCHET_ADMIN_TOKEN", raising=False)
        monkeypatch.setenv("RATCHET_PUBLIC_URL", url)
        monkeypatch.setenv("RATCHET_STATE_DIR", str(state))
        get_settings.cache_clear()
        yield state
    get_settings.cache_clear()


def test_loop_create_works_right_after_up(
    local_api: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["loop", "create", "myloop", "--env", "toolcalc", "--show-secrets"]) == 0
    assert "loop myloop created" in capsys.readouterr().out
    token_path(local_api).write_text("not-the-token\n")
    assert main(["loop", "list"]) == 1
    assert "<state dir>/admin-token" in capsys.readouterr().err
