"""The ``ratchet`` command.

Each command group lives in its own module under ``services.cli`` and exposes
``register(subparsers)``; a command sets ``func`` to a callable taking the parsed args and
returning an exit code. Errors a user can fix (:class:`CliError`, :class:`SettingsError`)
print one line and exit non-zero, never a traceback; a reader that stops reading
(``ratchet loop show NAME | head``) ends the command quietly.

Two kinds of command. Those that read or change a running Ratchet (``loop``, ``traces``,
``tasks``, ``datasets``, ``models import --loop``) go through the admin API with the typed
client (services.client) by one door, :func:`services.cli.common.call_api`, so they work the
same against a laptop and a cluster and never reach around the api's checks. Those that run
before an api exists, or are one of its processes, open what they need themselves: ``up``,
``api``, ``worker`` (they start the processes), ``db`` (migrations and re-encrypting secrets
are a deploy step that runs before the api, with the database URL and the secret key),
``serve`` and ``job`` (a model server and a job, which talk to no database), ``demo`` (it
starts a stack of its own), ``checkpoint`` and ``models import`` (files into the artifact
store).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from services.settings import SettingsError

# The command groups, in the order `ratchet --help` lists them.
COMMAND_MODULES = (
    "stack",
    "db",
    "loop",
    "traces",
    "tasks",
    "datasets",
    "job",
    "serve",
    "demo",
    "models",
)


class CliError(Exception):
    """A problem the user can fix; the message says what and how."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _version() -> str:
    """The installed package's version (the checkout's pyproject when run from source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ratchet")
    except PackageNotFoundError:
        return "0.1.0 (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratchet",
        description=(
            "Ratchet: continuous post-training for AI agents. Production failures in, "
            "better models out, serving quality only moves one way."
        ),
    )
    parser.add_argument("--version", action="version", version=f"ratchet {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"services.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"services.cli.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not in a traceback at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (CliError, SettingsError) as exc:
        print(f"ratchet: error: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, CliError) else 2
    except KeyboardInterrupt:
        return 130


def _reader_gone() -> int:
    """``ratchet ... | head``: the reader stopped reading. End quietly, as ``git log | head``
    does, with the status a process killed by SIGPIPE has. What is still buffered goes to
    /dev/null, so Python's flush at exit raises nothing either."""
    import os
    import signal

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
