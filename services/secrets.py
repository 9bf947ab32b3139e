"""Secrets at rest: webhook signing secrets are stored encrypted, never in clear.

HMAC needs the signing secret itself, so unlike ingest tokens (stored as sha256) it cannot be
hashed; it is encrypted with Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``) under
``RATCHET_SECRET_KEY``. A database dump or backup alone then holds nothing a sender could
sign with. The key comes from the environment (the chart's Secret); the embedded stack,
which has no Secret, keeps a generated key in ``<state_dir>/secret.key`` (mode 0600).

Rotation: ``RATCHET_SECRET_KEY`` is a comma-separated list of keys, newest first. The first
encrypts, every one decrypts (``MultiFernet``), so a new key is put in front, the processes
restarted, ``ratchet db reencrypt-secrets`` run, and the old key then removed.

A stored value is ``fernet:<token>``; a value without the prefix is a secret stored in
clear before encryption existed (migration 0002 encrypts those) and is read as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from services.secret_keys import generate_key, parse_keys
from services.settings import Settings, SettingsError

PREFIX = "fernet:"
KEY_FILE_NAME = "secret.key"


class SecretKeyError(Exception):
    """A stored secret cannot be decrypted with any configured key (the key was lost or
    removed too early); the message never holds the secret or the key."""


class SecretBox:
    """Encrypts with the newest key, decrypts with any of them."""

    def __init__(self, keys: list[Fernet]) -> None:
        self._fernet = MultiFernet(keys)
        self._newest = keys[0]

    @classmethod
    def from_keys(cls, raw: str) -> SecretBox:
        return cls(parse_keys(raw))

    @classmethod
    def from_settings(cls, settings: Settings) -> SecretBox:
        """The keys of ``RATCHET_SECRET_KEY``, or the embedded stack's key file."""
        if settings.secret_key is not None:
            return cls.from_keys(settings.secret_key.get_secret_value())
        return cls.from_keys(local_key(settings.state_dir / KEY_FILE_NAME))

    def encrypt(self, secret: str) -> str:
        return PREFIX + self._fernet.encrypt(secret.encode("utf-8")).decode("ascii")

    def decrypt(self, stored: str) -> str:
        if not stored.startswith(PREFIX):
            return stored  # stored in clear before encryption (see the module docstring)
        try:
            return self._fernet.decrypt(stored[len(PREFIX) :].encode("ascii")).decode("utf-8")
        except InvalidToken:
            raise SecretKeyError(
                "a stored signing secret does not decrypt with any key in RATCHET_SECRET_KEY; "
                "put back the key it was encrypted with"
            ) from None

    def reencrypt(self, stored: str) -> str:
        """The value encrypted under the newest key (after a key rotation)."""
        return self.encrypt(self.decrypt(stored))

    def is_current(self, stored: str) -> bool:
        """Whether the value is already encrypted under the newest key."""
        if not stored.startswith(PREFIX):
            return False
        try:
            self._newest.decrypt(stored[len(PREFIX) :].encode("ascii"))
        except InvalidToken:
            return False
        return True


def local_key(path: Path) -> str:
    """The embedded stack's key: read from ``path``, created (0600) on first use."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(generate_key() + "\n")
        try:
            os.link(staging, path)  # atomic: the first process to get here wins
        except FileExistsError:
            pass
        finally:
            staging.unlink()
    except OSError as exc:
        raise SettingsError(
            f"RATCHET_SECRET_KEY is not set and {path} cannot be created ({exc.strerror}); set "
            "RATCHET_SECRET_KEY or point RATCHET_STATE_DIR at a writable directory"
        ) from None
    return path.read_text().strip()
