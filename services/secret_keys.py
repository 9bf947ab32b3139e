"""Fernet keys as ``RATCHET_SECRET_KEY`` holds them: parsed (the settings check them at load)
and generated. Apart from :mod:`services.secrets`, which imports the settings, so the
settings can check a key without importing their own user."""

from __future__ import annotations

from cryptography.fernet import Fernet


def parse_keys(raw: str) -> list[Fernet]:
    """Fernet keys from a comma-separated list (newest first). The error names the position
    of the bad key, never its value."""
    keys = [part.strip() for part in raw.split(",") if part.strip()]
    if not keys:
        raise ValueError("must hold at least one Fernet key")
    fernets = []
    for position, key in enumerate(keys, start=1):
        try:
            fernets.append(Fernet(key))
        except ValueError:
            raise ValueError(
                f"key {position} of {len(keys)} is not a Fernet key (32 url-safe base64 bytes; "
                "make one with `ratchet db generate-key`)"
            ) from None
    return fernets


def generate_key() -> str:
    return Fernet.generate_key().decode("ascii")
