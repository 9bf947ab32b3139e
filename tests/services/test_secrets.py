"""Signing secrets at rest: encrypted under RATCHET_SECRET_KEY, with key rotation."""

from __future__ import annotations

import datetime as dt
import stat
from pathlib import Path

import pytest
from sqlalchemy import select

from services.db.models import Credential
from services.db.queries.loops import LoopFields
from services.db.session import SessionFactory
from services.ingest.credentials import CredentialCache
from services.ingest.provisioning import provision_loop, rotate_credential
from services.secrets import PREFIX, SecretBox, SecretKeyError, generate_key
from services.settings import Settings, SettingsError, load_settings


def test_a_provisioned_signing_secret_is_stored_encrypted_and_still_verifies(
    session_factory: SessionFactory,
) -> None:
    box = SecretBox.from_keys(generate_key())
    with session_factory.begin() as session:
        created = provision_loop(
            session, fields=LoopFields(name="enc", environment="toolcalc"), box=box
        )
    with session_factory() as session:
        stored = session.scalars(select(Credential.secret).where(Credential.secret.is_not(None)))
        values = list(stored)
    assert len(values) == 1 and values[0] is not None
    assert values[0].startswith(PREFIX)
    assert created.signing_secret not in values[0]
    assert box.decrypt(values[0]) == created.signing_secret

    async def keys() -> int:
        cache = CredentialCache(session_factory, box=box)
        found = await cache.loop_keys("enc")
        assert found is not None
        return len(found.active(dt.datetime.now(dt.UTC)))

    import asyncio

    assert asyncio.run(keys()) == 1


def test_key_rotation_decrypts_old_values_and_encrypts_with_the_newest() -> None:
    old, new = generate_key(), generate_key()
    stored = SecretBox.from_keys(old).encrypt("whsec_x")
    rotated = SecretBox.from_keys(f"{new},{old}")
    assert rotated.decrypt(stored) == "whsec_x"
    assert not rotated.is_current(stored)
    again = rotated.reencrypt(stored)
    assert rotated.is_current(again)
    assert SecretBox.from_keys(new).decrypt(again) == "whsec_x"
    with pytest.raises(SecretKeyError) as caught:
        SecretBox.from_keys(generate_key()).decrypt(stored)
    assert "whsec_x" not in str(caught.value)
    assert SecretBox.from_keys(new).decrypt("whsec_legacy") == "whsec_legacy"  # in clear


def test_a_bad_secret_key_is_refused_without_echoing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_SECRET_KEY", f"{generate_key()},not-a-key-hunter2")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "RATCHET_SECRET_KEY" in str(caught.value) and "key 2 of 2" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_no_setting_error_echoes_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_DATABASE_URL", "mysql://admin:hunter2@db:3306/x")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "RATCHET_DATABASE_URL" in str(caught.value) and "hunter2" not in str(caught.value)
    monkeypatch.delenv("RATCHET_DATABASE_URL")
    monkeypatch.setenv("RATCHET_TEMPORAL_API_KEY", "x")
    monkeypatch.setenv("RATCHET_API_PORT", "hunter2-not-a-port")
    with pytest.raises(SettingsError, match="got 'hunter2-not-a-port'"):
        load_settings()  # an ordinary setting is still shown, to help


def test_the_embedded_stack_generates_a_private_key_file_once(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    first = SecretBox.from_settings(settings).encrypt("whsec_y")
    key_file = tmp_path / "secret.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert SecretBox.from_settings(Settings(state_dir=tmp_path)).decrypt(first) == "whsec_y"


def test_concurrent_rotations_leave_at_most_two_active_secrets(
    session_factory: SessionFactory,
) -> None:
    """Each rotation locks the loop's row; without the lock two interleaved rotations can
    each leave the other's new secret (or the original) active with no expiry."""
    import threading

    box = SecretBox.from_keys(generate_key())
    with session_factory.begin() as session:
        loop = provision_loop(
            session, fields=LoopFields(name="rot", environment="toolcalc"), box=box
        ).loop
        loop_id = loop.id
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def rotate() -> None:
        try:
            with session_factory.begin() as session:
                from services.db.models import Loop

                row = session.get(Loop, loop_id)
                assert row is not None
                barrier.wait()
                rotate_credential(
                    session,
                    loop=row,
                    kind="signing_secret",
                    grace=dt.timedelta(hours=1),
                    box=box,
                )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rotate) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    now = dt.datetime.now(dt.UTC)
    with session_factory() as session:
        secrets = session.scalars(
            select(Credential).where(
                Credential.loop_id == loop_id, Credential.kind == "signing_secret"
            )
        ).all()
    active = [c for c in secrets if c.expires_at is None or c.expires_at > now]
    never_expiring = [c for c in secrets if c.expires_at is None]
    assert len(secrets) == 5
    assert len(active) <= 2 and len(never_expiring) == 1


def test_reencrypt_secrets_moves_every_secret_to_the_newest_key(
    database_url: str,
    session_factory: SessionFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    old, new = generate_key(), generate_key()
    with session_factory.begin() as session:
        created = provision_loop(
            session,
            fields=LoopFields(name="rekey", environment="toolcalc"),
            box=SecretBox.from_keys(old),
        )
    monkeypatch.setenv("RATCHET_DATABASE_URL", database_url)
    monkeypatch.setenv("RATCHET_SECRET_KEY", f"{new},{old}")
    assert main(["db", "reencrypt-secrets"]) == 0
    assert "re-encrypted 1 signing secret" in capsys.readouterr().out
    with session_factory() as session:
        stored = session.scalars(select(Credential.secret).where(Credential.secret.is_not(None)))
        (value,) = list(stored)
    assert value is not None
    assert SecretBox.from_keys(new).decrypt(value) == created.signing_secret
