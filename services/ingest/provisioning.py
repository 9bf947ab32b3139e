"""Creating loops with their ingest credentials, and rotating those credentials.

Kept out of the route so that other callers (the lead's loop actions, which also start the
loop's Temporal workflow on creation) reuse one function: :func:`provision_loop` does
everything that belongs in the loop's creating transaction and returns the secrets, which
are shown once and never again (the signing secret is stored because HMAC needs it,
encrypted under ``RATCHET_SECRET_KEY`` (services.secrets); the ingest token and the gateway
key only as their sha256).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.orm import Session

from services.db.models import Loop
from services.db.queries.credentials import (
    GATEWAY_KEY,
    INGEST_TOKEN,
    SIGNING_SECRET,
    active_credentials,
    add_gateway_key,
    add_ingest_token,
    add_signing_secret,
    expire_credentials,
    lock_loop,
)
from services.db.queries.loops import LoopFields, create_loop
from services.ingest.credentials import generate_gateway_key, generate_ingest_token, hash_token
from services.ingest.signature import generate_secret
from services.secrets import SecretBox

CredentialKind = Literal["signing_secret", "ingest_token", "gateway_key"]


@dataclass(frozen=True)
class ProvisionedLoop:
    """A new loop and its credentials in clear (to be shown once)."""

    loop: Loop
    signing_secret: str
    ingest_token: str
    gateway_key: str


def provision_loop(session: Session, *, fields: LoopFields, box: SecretBox) -> ProvisionedLoop:
    """Create a loop with one signing secret, one ingest token and one gateway key, in the
    caller's transaction.

    Raises :class:`services.db.queries.loops.LoopNameTaken` when the name is in use.
    """
    loop = create_loop(session=session, fields=fields)
    signing_secret = generate_secret()
    ingest_token = generate_ingest_token()
    add_signing_secret(session=session, loop_id=loop.id, secret=box.encrypt(signing_secret))
    add_ingest_token(session=session, loop_id=loop.id, token_sha256=hash_token(ingest_token))
    gateway_key = generate_gateway_key()
    add_gateway_key(session=session, loop_id=loop.id, key_sha256=hash_token(gateway_key))
    return ProvisionedLoop(
        loop=loop,
        signing_secret=signing_secret,
        ingest_token=ingest_token,
        gateway_key=gateway_key,
    )


@dataclass(frozen=True)
class RotatedCredential:
    """The new credential in clear, and until when the previous one keeps working."""

    kind: CredentialKind
    value: str
    previous_expires_at: dt.datetime | None


def rotate_credential(
    session: Session,
    *,
    loop: Loop,
    kind: CredentialKind,
    grace: dt.timedelta,
    box: SecretBox,
    now: dt.datetime | None = None,
) -> RotatedCredential:
    """Issue a new credential; the current one stays valid for ``grace``, then expires.

    At most two are active at once: one still in an earlier grace period expires now. The
    loop's row is locked first, so concurrent rotations run one after the other (two that
    interleaved could each keep the other's new credential active forever).
    """
    now = now or dt.datetime.now(dt.UTC)
    lock_loop(session=session, loop_id=loop.id)
    had_active = bool(active_credentials(session=session, loop_id=loop.id, now=now, kind=kind))
    expires_at = now + grace
    expire_credentials(session=session, loop_id=loop.id, kind=kind, now=now, at=expires_at)
    if kind == SIGNING_SECRET:
        value = generate_secret()
        add_signing_secret(session=session, loop_id=loop.id, secret=box.encrypt(value))
    elif kind == INGEST_TOKEN:
        value = generate_ingest_token()
        add_ingest_token(session=session, loop_id=loop.id, token_sha256=hash_token(value))
    elif kind == GATEWAY_KEY:
        value = generate_gateway_key()
        add_gateway_key(session=session, loop_id=loop.id, key_sha256=hash_token(value))
    else:  # pragma: no cover - the Literal type and the api schema exclude it
        raise ValueError(f"unknown credential kind {kind!r}")
    return RotatedCredential(
        kind=kind, value=value, previous_expires_at=expires_at if had_active else None
    )
