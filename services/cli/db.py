"""`ratchet db upgrade|downgrade|current`: migrations as a deploy step."""

from __future__ import annotations

import argparse
from typing import Any

from services.cli.common import add_command, cli_settings, command_group, database_url


def register(subparsers: Any) -> None:
    db_commands = command_group(subparsers, "db", help="database migrations")
    upgrade = add_command(
        db_commands, "upgrade", _upgrade, help="apply migrations up to REVISION (head)"
    )
    upgrade.add_argument("revision", nargs="?", default="head")
    downgrade = add_command(
        db_commands, "downgrade", _downgrade, help="revert migrations down to REVISION"
    )
    downgrade.add_argument("revision")
    add_command(db_commands, "current", _current, help="print the revision the database is at")
    add_command(
        db_commands,
        "generate-key",
        _generate_key,
        help="print a new key for RATCHET_SECRET_KEY (encrypts signing secrets)",
    )
    add_command(
        db_commands,
        "reencrypt-secrets",
        _reencrypt,
        help="re-encrypt stored signing secrets under the first key of RATCHET_SECRET_KEY",
    )


def _upgrade(args: argparse.Namespace) -> int:
    from services.db.migrate import current_heads, upgrade

    with database_url() as url:
        upgrade(url, args.revision)
        print(f"database at {', '.join(current_heads(url)) or 'base'}")
    return 0


def _downgrade(args: argparse.Namespace) -> int:
    from services.db.migrate import current_heads, downgrade

    with database_url() as url:
        downgrade(url, args.revision)
        print(f"database at {', '.join(current_heads(url)) or 'base'}")
    return 0


def _current(args: argparse.Namespace) -> int:
    from services.db.migrate import current_heads

    with database_url() as url:
        print(", ".join(current_heads(url)) or "base (no migrations applied)")
    return 0


def _generate_key(args: argparse.Namespace) -> int:
    from services.secrets import generate_key

    print(generate_key())
    return 0


def _reencrypt(args: argparse.Namespace) -> int:
    """After putting a new key in front of RATCHET_SECRET_KEY (new,old) and restarting, run
    this; then the old key can be removed.
    """
    from services.db.queries.credentials import signing_secrets
    from services.db.session import create_db_engine, make_session_factory
    from services.secrets import SecretBox

    settings = cli_settings()
    box = SecretBox.from_settings(settings)
    with database_url() as url:
        engine = create_db_engine(url, pool_size=1)
        try:
            with make_session_factory(engine).begin() as session:
                stale = [
                    c
                    for c in signing_secrets(session=session)
                    if c.secret and not box.is_current(c.secret)
                ]
                for credential in stale:
                    assert credential.secret is not None
                    credential.secret = box.reencrypt(credential.secret)
        finally:
            engine.dispose()
    print(f"re-encrypted {len(stale)} signing secret(s) under the newest key")
    return 0
