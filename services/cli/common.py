"""Helpers shared by CLI commands."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from services.settings import Settings, get_settings


def cli_settings(*, require_database: bool = False) -> Settings:
    """Settings for a command; processes that need a database say so in one line."""
    from services.cli import CliError

    settings = get_settings()
    if require_database and settings.database_url is None:
        raise CliError(
            "RATCHET_DATABASE_URL is not set; set it to your Postgres, or run `ratchet up` "
            "to start the embedded stack"
        )
    return settings


def command_group(subparsers: Any, name: str, *, help: str) -> Any:
    """``ratchet NAME COMMAND ...``: the subparsers of a group whose command is required."""
    group = subparsers.add_parser(name, help=help)
    return group.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)


def add_command(
    subparsers: Any, name: str, handler: Callable[[argparse.Namespace], int], *, help: str
) -> argparse.ArgumentParser:
    """A command whose ``--help`` description is its handler's docstring, as click does: what
    a command tells its user stays next to the code that does it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help, description=inspect.getdoc(handler)
    )
    parser.set_defaults(func=handler)
    return parser


LOOP_HELP = "the loop's name (`--loop NAME`; a command about one loop also takes it as NAME)"


def add_loop_argument(parser: argparse.ArgumentParser, *, positional: bool) -> None:
    """The one way to name a loop: ``--loop NAME`` on every command about a loop; a command
    whose only argument is the loop also takes it as a positional ``NAME`` (``ratchet loop
    show NAME`` and ``ratchet loop show --loop NAME`` are the same). :func:`loop_name` reads
    it back, so handlers never care which form was used."""
    parser.add_argument("--loop", dest="loop_option", metavar="NAME", help=LOOP_HELP)
    if positional:
        parser.add_argument("loop_positional", nargs="?", metavar="NAME", help=LOOP_HELP)


def loop_name(args: argparse.Namespace) -> str:
    """The loop named by :func:`add_loop_argument`'s forms; a CliError when none, or two
    different ones, were given."""
    from services.cli import CliError

    option = getattr(args, "loop_option", None)
    positional = getattr(args, "loop_positional", None)
    if option and positional and option != positional:
        raise CliError(f"two loops named: {positional!r} and --loop {option!r}; give one")
    name = option or positional
    if not name:
        raise CliError("name the loop: --loop NAME (see `ratchet loop list`)")
    return str(name)


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


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def admin_token_for_cli(settings: Any) -> str | None:
    """RATCHET_ADMIN_TOKEN, else the local stack's (`ratchet up`) for an api on this machine."""
    if settings.admin_token is not None:
        return str(settings.admin_token.get_secret_value())
    from services.local.admin_token import is_loopback_url, read_local_admin_token

    if is_loopback_url(settings.api_base_url):
        return read_local_admin_token(settings.state_dir)
    return None


def call_api(action: Callable[[Any], Any], *, invalid: str | None = None) -> Any:
    """Run ``action(client)`` against the admin API (``settings.api_base_url`` with the admin
    token): the one door of every command that reads or changes a running Ratchet. Its
    failures become one line, the api's own message, which names the loop, task or field at
    fault; ``invalid`` names what a 422 refused (``invalid loop: name: ...``)."""
    from services.cli import CliError
    from services.client import ApiRequestError, ApiUnreachable, RatchetClient

    settings = cli_settings()
    try:
        with RatchetClient(settings.api_base_url, admin_token_for_cli(settings)) as client:
            return action(client)
    except ApiUnreachable as exc:
        raise CliError(f"{exc} (is `ratchet api` or `ratchet up` running?)", exit_code=1) from None
    except ApiRequestError as exc:
        raise CliError(explain(exc, invalid=invalid), exit_code=1) from None


def explain(exc: Any, *, invalid: str | None = None) -> str:
    """An api error as the one line a command prints (``exc``: services.client's
    ApiRequestError), with what to do next where the api's message cannot say it."""
    # A field whose message is the error's own is named once, by the message.
    fields = "; ".join(
        f"{f['path']}: {f['message']}" for f in exc.fields if f["message"] != exc.message
    )
    if exc.status_code == 401:
        return (
            "the api refused the admin token: set RATCHET_ADMIN_TOKEN to the api's admin token "
            "(a local `ratchet up` prints it and keeps it in <state dir>/admin-token)"
        )
    if exc.code == "loop_not_found":
        return f"{exc.message} (see `ratchet loop list`)"
    if exc.code == "loop_exists":
        return f"{exc.message}; choose another name"
    if exc.code == "invalid_checkpoint":  # set-champion: the reason the api gave, as it is
        return f"checkpoint refused: {exc.message}"
    if exc.status_code == 422 and invalid is not None:
        return f"invalid {invalid}: {fields or exc.message}"
    if exc.status_code >= 500:
        return f"the api answered {exc.status_code} {exc.code}: {exc.message}"
    return str(exc.message) + (f" ({fields})" if fields else "")


def actor(given: str | None) -> str:
    """Who makes a change (kept in the loop's history): ``given``, else user@host."""
    if given:
        return given
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
