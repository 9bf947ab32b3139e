"""`ratchet db upgrade|downgrade|current`: migrations as a deploy step."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from services.cli.common import cli_settings


def register(subparsers: Any) -> None:
    db = subparsers.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    upgrade = db_commands.add_parser("upgrade", help="apply migrations up to REVISION (head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(func=_upgrade)
    downgrade = db_commands.add_parser("downgrade", help="revert migrations down to REVISION")
    downgrade.add_argument("revision")
    downgrade.set_defaults(func=_downgrade)
    current = db_commands.add_parser("current", help="print the revision the database is at")
    current.set_defaults(func=_current)


@contextmanager
def database_url() -> Iterator[str]:
    """The configured database, or the embedded one under the state dir for the command."""
    from services.cli import CliError
    from services.local.stack import EmbeddedPostgres, StackError, check_postgres_reachable

    settings = cli_settings()
    if settings.database_url is not None:
        try:
            check_postgres_reachable(settings.database_url)
        except StackError as exc:
            raise CliError(str(exc), exit_code=1) from None
        yield settings.database_url
        return
    embedded = EmbeddedPostgres(settings.embedded_postgres_dir)
    try:
        yield embedded.start()
    except StackError as exc:
        raise CliError(str(exc), exit_code=1) from None
    finally:
        embedded.stop()


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
