"""Migration 0002 encrypts signing secrets stored in clear (and its downgrade restores them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text

from services.db.migrate import downgrade, upgrade
from services.secrets import PREFIX, SecretBox, generate_key
from services.settings import get_settings, to_sqlalchemy_url


@pytest.fixture
def secret_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    key = generate_key()
    monkeypatch.setenv("RATCHET_SECRET_KEY", key)
    get_settings.cache_clear()
    yield key
    get_settings.cache_clear()


def test_secrets_in_clear_are_encrypted_by_the_upgrade(
    make_database: Callable[[], str], secret_key: str
) -> None:
    url = make_database()
    downgrade(url, "0001")
    engine = create_engine(to_sqlalchemy_url(url))
    with engine.begin() as connection:
        loop_id = connection.execute(
            text("INSERT INTO loops (name, environment) VALUES ('old', 'toolcalc') RETURNING id")
        ).scalar_one()
        connection.execute(
            text(
                "INSERT INTO credentials (loop_id, kind, secret) "
                "VALUES (:loop, 'signing_secret', 'whsec_aGVsbG8=')"
            ),
            {"loop": loop_id},
        )
    upgrade(url)
    with engine.connect() as connection:
        stored = connection.execute(text("SELECT secret FROM credentials")).scalar_one()
    assert stored.startswith(PREFIX) and "aGVsbG8" not in stored
    assert SecretBox.from_keys(secret_key).decrypt(stored) == "whsec_aGVsbG8="
    downgrade(url, "0001")
    with engine.connect() as connection:
        stored = connection.execute(text("SELECT secret FROM credentials")).scalar_one()
    engine.dispose()
    assert stored == "whsec_aGVsbG8="
