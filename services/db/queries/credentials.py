"""Webhook signing secrets and ingest tokens of loops. The caller owns the transaction.

A credential is active while ``expires_at`` is null or in the future; a rotation gives the
old one an expiry (the grace period) and adds a new one, so both work meanwhile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session

from services.db.models import Credential, Loop
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop

SIGNING_SECRET = "signing_secret"
INGEST_TOKEN = "ingest_token"
GATEWAY_KEY = "gateway_key"


def _active(now: dt.datetime) -> ColumnElement[bool]:
    return or_(Credential.expires_at.is_(None), Credential.expires_at > now)


def lock_loop(*, session: Session, loop_id: int) -> None:
    """Hold the loop's row (``FOR UPDATE``) until the caller's transaction ends, so changes to
    its credentials happen one transaction at a time."""
    session.execute(select(Loop.id).where(Loop.id == loop_id).with_for_update())


def add_signing_secret(*, session: Session, loop_id: int, secret: str) -> Credential:
    """``secret`` is stored as given: the caller passes it encrypted (services.secrets)."""
    credential = Credential(loop_id=loop_id, kind=SIGNING_SECRET, secret=secret)
    session.add(credential)
    session.flush()
    return credential


def add_ingest_token(*, session: Session, loop_id: int, token_sha256: str) -> Credential:
    """Ingest tokens are stored as their sha256 only: a database leak does not leak them."""
    credential = Credential(loop_id=loop_id, kind=INGEST_TOKEN, token_sha256=token_sha256)
    session.add(credential)
    session.flush()
    return credential


def add_gateway_key(*, session: Session, loop_id: int, key_sha256: str) -> Credential:
    """Gateway keys, like ingest tokens, are stored as their sha256 only."""
    credential = Credential(loop_id=loop_id, kind=GATEWAY_KEY, token_sha256=key_sha256)
    session.add(credential)
    session.flush()
    return credential


def active_gateway_keys(
    *, session: Session, now: dt.datetime
) -> Sequence[tuple[str, dt.datetime | None, Loop]]:
    """Every active gateway key's sha256 and expiry, with its loop (the gateway's key table,
    read whole every few seconds: one row per loop and rotation, so a small table)."""
    rows = session.execute(
        select(Credential.token_sha256, Credential.expires_at, Loop)
        .join(Loop, Loop.id == Credential.loop_id)
        .where(Credential.kind == GATEWAY_KEY, Credential.token_sha256.is_not(None), _active(now))
    ).all()
    return [(str(digest), expires_at, loop) for digest, expires_at, loop in rows]


def active_credentials(
    *, session: Session, loop_id: int, now: dt.datetime, kind: str | None = None
) -> Sequence[Credential]:
    query = select(Credential).where(Credential.loop_id == loop_id, _active(now))
    if kind is not None:
        query = query.where(Credential.kind == kind)
    return session.scalars(query.order_by(Credential.created_at, Credential.id)).all()


def expire_credentials(
    *, session: Session, loop_id: int, kind: str, now: dt.datetime, at: dt.datetime
) -> None:
    """Let every active credential of a kind expire at ``at`` (sooner if it expires earlier).

    One already in a grace period ends now, so a rotation leaves at most two active.
    """
    session.execute(
        update(Credential)
        .where(
            Credential.loop_id == loop_id,
            Credential.kind == kind,
            Credential.expires_at.is_not(None),
            Credential.expires_at > now,
        )
        .values(expires_at=now)
    )
    session.execute(
        update(Credential)
        .where(
            Credential.loop_id == loop_id,
            Credential.kind == kind,
            Credential.expires_at.is_(None),
        )
        .values(expires_at=at)
    )


def signing_secrets_for(
    *, session: Session, loop_name: str, now: dt.datetime
) -> tuple[Loop, Sequence[Credential]] | None:
    """A loop and its active signing secrets, by loop name; None if there is no such loop."""
    try:
        loop = require_loop(session=session, name=loop_name)
    except NotFound:
        return None
    return loop, active_credentials(session=session, loop_id=loop.id, now=now, kind=SIGNING_SECRET)


def signing_secrets(*, session: Session) -> Sequence[Credential]:
    """Every stored signing secret, expired ones too (for re-encryption under a new key)."""
    return session.scalars(
        select(Credential).where(Credential.kind == SIGNING_SECRET, Credential.secret.is_not(None))
    ).all()


def loop_names(*, session: Session) -> Sequence[str]:
    """Every loop's name (the webhook's cache checks a path against them before a lookup)."""
    return session.scalars(select(Loop.name)).all()


def active_token_digests(*, session: Session, now: dt.datetime) -> Sequence[str]:
    """The sha256 of every active ingest token (the OTLP door's cache checks a token against
    them before a lookup)."""
    return session.scalars(
        select(Credential.token_sha256).where(
            Credential.kind == INGEST_TOKEN, Credential.token_sha256.is_not(None), _active(now)
        )
    ).all()  # type: ignore[return-value]


def loop_for_token(
    *, session: Session, token_sha256: str, now: dt.datetime, kind: str = INGEST_TOKEN
) -> tuple[Loop, Credential] | None:
    """The loop an active ingest token (or gateway key, by ``kind``) belongs to."""
    row = session.execute(
        select(Loop, Credential)
        .join(Credential, Credential.loop_id == Loop.id)
        .where(
            Credential.kind == kind,
            Credential.token_sha256 == token_sha256,
            _active(now),
        )
    ).first()
    return (row[0], row[1]) if row is not None else None
