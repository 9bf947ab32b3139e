"""``ratchet loop create`` and ``ratchet loop rotate-secret``: a loop's ingest credentials.

A new loop's gateway key, webhook signing secret and OTLP ingest token are shown once: they
go to a new 0600 file (``--secret-file``) or, asked for, to stdout (``--show-secrets``);
``loop apply`` creating a loop shares the same options and printing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from services.cli.common import actor, add_command
from services.cli.loop.parsing import call, loop_command, print_model, print_warnings


def register(commands: Any) -> None:
    """``loop create`` and ``loop rotate-secret``."""
    create = add_command(
        commands,
        "create",
        _create,
        help="create a loop; its gateway key, signing secret and ingest token (shown once) go to "
        "--secret-file PATH (0600) or, with --show-secrets, to stdout",
    )
    create.add_argument("name", help="loop name: lowercase letters, digits, dashes (DNS label)")
    create.add_argument(
        "--env", required=True, dest="environment", help="environment, e.g. toolcalc"
    )
    create.add_argument("--executor", choices=("local", "kubernetes"), default="local")
    create.add_argument("--budget-usd", type=_budget, default=None, help="spend cap in USD")
    create.add_argument(
        "--model",
        default=None,
        help="the served model name the loop's agents call (serving_target.model; default "
        "ratchet): each loop serving on one server needs a name of its own",
    )
    create.add_argument("--json", action="store_true", help="print one JSON object")
    add_secret_options(create)

    rotate = loop_command(
        commands,
        "rotate-secret",
        _rotate,
        help="issue a new signing secret; the old one works for the grace period",
    )
    rotate.add_argument("--grace-seconds", type=_grace, default=86400)
    which = rotate.add_mutually_exclusive_group()
    which.add_argument(
        "--ingest-token", action="store_true", help="rotate the OTLP ingest token instead"
    )
    which.add_argument(
        "--gateway-key",
        action="store_true",
        help="rotate the capture gateway's key instead (--grace-seconds 0 revokes the old one "
        "at once)",
    )
    rotate.add_argument("--json", action="store_true", help="print one JSON object")


def add_secret_options(parser: argparse.ArgumentParser, *, creating: str = "") -> None:
    parser.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help=f"{creating}write the new loop's gateway key, signing secret and ingest token to "
        "PATH, a new file (mode 0600, JSON)",
    )
    parser.add_argument(
        "--show-secrets",
        action="store_true",
        help=f"{creating}print the gateway key, signing secret and ingest token (they are shown "
        "once; a terminal's scrollback or a CI log keeps them)",
    )


def _budget(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_finite() or value < 0:
        raise argparse.ArgumentTypeError("must be a non-negative number of dollars")
    return value


def _grace(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}") from None
    if not 0 <= value <= 30 * 86400:
        raise argparse.ArgumentTypeError("must be between 0 and 2592000 (30 days)")
    return value


def _create(args: argparse.Namespace) -> int:
    from services.client import LoopPolicies

    check_secret_destination(args)
    created = call(
        lambda client: client.create_loop(
            args.name,
            args.environment,
            executor=args.executor,
            budget_usd=args.budget_usd,
            changed_by=actor(None),
            policies=LoopPolicies(
                serving_target={"model": args.model} if args.model is not None else None
            ),
        ),
    )
    written = write_secret_file(args, created)
    if args.json:
        print_created_json(args, created, written)
        return 0
    print(f"loop {created.name} created", end=" ")
    print(f"(environment {created.environment}, executor {created.executor})")
    print_created(args, created, written)
    return 0


# What --secret-file holds: the new loop's credentials and where to use them.
_SECRET_FIELDS = ("signing_secret", "ingest_token", "gateway_key")


def check_secret_destination(args: argparse.Namespace) -> None:
    """Before a loop is created: its secrets, shown once, must have somewhere to go."""
    from services.cli import CliError

    if args.secret_file is None and not args.show_secrets:
        raise CliError(
            "a new loop's gateway key, signing secret and ingest token are shown once: pass "
            "--secret-file PATH to write them to a new file (mode 0600), or --show-secrets to "
            "print them"
        )
    if args.secret_file is not None:
        path = Path(args.secret_file)
        if os.path.lexists(path):
            raise CliError(
                f"--secret-file {path} exists: the secrets go to a new file only; choose "
                "another path or remove it"
            )
        if not path.parent.is_dir():
            raise CliError(f"--secret-file {path}: the directory {path.parent} does not exist")


def write_secret_file(args: argparse.Namespace, created: Any) -> Path | None:
    """Write the secrets to a new 0600 file; if that fails now, print them to stderr rather
    than lose them (the loop exists already)."""
    if args.secret_file is None:
        return None
    path = Path(args.secret_file)
    document = {
        "loop": created.name,
        "webhook_url": created.webhook_url,
        "otlp_traces_url": created.otlp_traces_url,
        "gateway_url": created.gateway_url,
        **{name: getattr(created, name) for name in _SECRET_FIELDS},
    }
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        print(
            f"ratchet: cannot write {path} ({exc.strerror}); the secrets, shown once:\n"
            + json.dumps(document, indent=2),
            file=sys.stderr,
        )
        return None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(document, indent=2) + "\n")
    return path


def print_created_json(args: argparse.Namespace, created: Any, written: Path | None) -> None:
    document = created.model_dump(mode="json")
    if not args.show_secrets:
        for name in _SECRET_FIELDS:
            document.pop(name)
    if written is not None:
        document["secret_file"] = str(written)
    print(json.dumps(document, indent=2))


def print_created(args: argparse.Namespace, created: Any, written: Path | None) -> None:
    print(f"gateway:        base_url {created.gateway_url}  (OpenAI-compatible)")
    if args.show_secrets:
        print(f"gateway key:    {created.gateway_key}")
    print(f"webhook:        POST {created.webhook_url}")
    if args.show_secrets:
        print(f"signing secret: {created.signing_secret}")
    print(f"otlp endpoint:  POST {created.otlp_traces_url}")
    if args.show_secrets:
        print(f"ingest token:   {created.ingest_token}")
    if written is not None:
        print(f"gateway key, signing secret and ingest token written to {written} (mode 0600)")
    print("they are not shown again (rotate with `ratchet loop rotate-secret`)")
    print_warnings(created.warnings)


_LABELS = {
    "signing_secret": "signing secret",
    "ingest_token": "ingest token",
    "gateway_key": "gateway key",
}


def _rotate(args: argparse.Namespace) -> int:
    kind = (
        "ingest_token"
        if args.ingest_token
        else "gateway_key"
        if args.gateway_key
        else "signing_secret"
    )
    rotated = call(
        lambda client: client.rotate_secret(args.name, grace_seconds=args.grace_seconds, kind=kind),
    )
    if args.json:
        print_model(rotated)
        return 0
    print(f"new {_LABELS[kind]} for {rotated.loop}: {rotated.secret}")
    if rotated.previous_expires_at is not None:
        print(f"the previous one keeps working until {rotated.previous_expires_at}")
    return 0
