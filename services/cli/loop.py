"""``ratchet loop ...``: loops, their ingest credentials, champion and operator actions.

The commands call the admin API at ``settings.api_base_url`` with ``RATCHET_ADMIN_TOKEN``;
every failure a user can fix is one line (api unreachable, wrong token, no such loop, name
taken, invalid field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from services.cli.common import (
    add_command,
    add_loop_argument,
    admin_token_for_cli,
    cli_settings,
    command_group,
    loop_name,
    positive_int,
)

if TYPE_CHECKING:
    from services.api.schemas.ledger import ServingLedgerPublic


def register(subparsers: Any) -> None:
    commands = command_group(
        subparsers,
        "loop",
        help="create, list, show loops; apply a loop file, its history and export; rotate "
        "secrets; set the champion; pause, resume, approve, rollback",
    )

    create = add_command(
        commands,
        "create",
        _create,
        help="create a loop; its webhook signing secret and ingest token (shown once) go to "
        "--secret-file PATH (0600) or, with --show-secrets, to stdout",
    )
    create.add_argument("name", help="loop name: lowercase letters, digits, dashes (DNS label)")
    create.add_argument(
        "--env", required=True, dest="environment", help="environment, e.g. toolcalc"
    )
    create.add_argument("--executor", choices=("local", "kubernetes"), default="local")
    create.add_argument("--budget-usd", type=_budget, default=None, help="spend cap in USD")
    create.add_argument("--json", action="store_true", help="print one JSON object")
    _add_secret_options(create)

    listing = add_command(commands, "list", _list, help="list loops")
    listing.add_argument("--json", action="store_true", help="print a JSON array")

    show = _loop_command(
        commands, "show", _show, help="show a loop, its traffic and active credentials"
    )
    show.add_argument("--json", action="store_true", help="print one JSON object")

    rotate = _loop_command(
        commands,
        "rotate-secret",
        _rotate,
        help="issue a new signing secret; the old one works for the grace period",
    )
    rotate.add_argument("--grace-seconds", type=_grace, default=86400)
    rotate.add_argument(
        "--ingest-token", action="store_true", help="rotate the OTLP ingest token instead"
    )
    rotate.add_argument("--json", action="store_true", help="print one JSON object")

    status = _loop_command(
        commands, "status", _status, help="the loop's stage, cycle and what it waits for"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")

    champion = _loop_command(
        commands,
        "set-champion",
        _set_champion,
        help="register a checkpoint directory as the loop's champion (e.g. the first one)",
    )
    champion.add_argument("checkpoint", help="checkpoint directory (path or file:// URI)")
    champion.add_argument("--reason", default=None)

    apply = add_command(
        commands,
        "apply",
        _apply,
        help="create or update a loop from a loop file (like kubectl apply); --dry-run shows "
        "the diff",
    )
    apply.add_argument("-f", "--file", required=True, help="loop file (YAML or JSON)")
    apply.add_argument(
        "--dry-run", action="store_true", help="validate and print the diff, change nothing"
    )
    apply.add_argument("--by", default=None, help="who makes the change (default: user@host)")
    apply.add_argument("--reason", default=None, help="why, kept in the loop's history")
    apply.add_argument("--json", action="store_true", help="print one JSON object")
    _add_secret_options(apply, creating="when the file creates the loop: ")

    history = _loop_command(
        commands,
        "history",
        _history,
        help="the loop's configuration versions: who changed what, when",
    )
    history.add_argument("--limit", type=positive_int, default=20, help="newest versions to show")
    history.add_argument("--json", action="store_true", help="print a JSON array")

    _loop_command(
        commands,
        "export",
        _export,
        help="print the loop's configuration as a loop file for `ratchet loop apply`",
    )

    _loop_command(commands, "start", _start, help="start the loop's workflow (idempotent)")

    for action, help_text in ACTIONS.items():
        command = _loop_command(commands, action, _action, help=help_text)
        command.add_argument("--reason", default=None, help="recorded with the action")
        if action in ("approve", "reject"):
            command.add_argument("--cycle", type=int, default=0, help="cycle (default: current)")
            command.add_argument("--by", default=None, help="who decides (default: operator)")
        command.set_defaults(action=action)


def _add_secret_options(parser: argparse.ArgumentParser, *, creating: str = "") -> None:
    parser.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help=f"{creating}write the new loop's signing secret and ingest token to PATH, a new "
        "file (mode 0600, JSON)",
    )
    parser.add_argument(
        "--show-secrets",
        action="store_true",
        help=f"{creating}print the signing secret and ingest token (they are shown once; a "
        "terminal's scrollback or a CI log keeps them)",
    )


def _loop_command(
    commands: Any, command: str, handler: Callable[[argparse.Namespace], int], *, help: str
) -> argparse.ArgumentParser:
    """A command about one loop: ``ratchet loop show NAME`` or ``... show --loop NAME``
    (services.cli.common.add_loop_argument); the handler reads ``args.name``."""
    parser = add_command(commands, command, handler, help=help)
    add_loop_argument(parser, positional=True)

    def named(args: argparse.Namespace) -> int:
        args.name = loop_name(args)
        return handler(args)

    parser.set_defaults(func=named)
    return parser


ACTIONS = {
    "pause": "pause the loop: no new cycle starts",
    "resume": "resume a paused loop",
    "run-now": "start a cycle now, without waiting for a trigger",
    "approve": "approve the candidate waiting at a manual gate",
    "reject": "reject the candidate waiting at a manual gate",
    "rollback": "roll back to the champion before the last promotion",
}


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


def _client() -> Any:
    from services.client import RatchetClient

    settings = cli_settings()
    return RatchetClient(settings.api_base_url, admin_token_for_cli(settings))


def _call(args: argparse.Namespace, action: Any) -> Any:
    """Run an API call and turn its failures into one clear line."""
    from services.cli import CliError
    from services.client import ApiRequestError, ApiUnreachable

    name = getattr(args, "name", None)
    try:
        with _client() as client:
            return action(client)
    except ApiUnreachable as exc:
        raise CliError(f"{exc} (is `ratchet api` or `ratchet up` running?)", exit_code=1) from None
    except ApiRequestError as exc:
        raise CliError(_explain(exc, name), exit_code=1) from None


def _explain(exc: Any, name: str | None) -> str:
    if exc.status_code == 401:
        return (
            "the api refused the admin token: set RATCHET_ADMIN_TOKEN to the api's admin token "
            "(a local `ratchet up` prints it and keeps it in <state dir>/admin-token)"
        )
    if exc.status_code == 403:
        return exc.message
    if exc.status_code == 404:
        return f"there is no loop named {name!r} (see `ratchet loop list`)"
    if exc.status_code == 409 and exc.code == "loop_exists":
        return f"a loop named {name!r} already exists; choose another name"
    if exc.code == "invalid_checkpoint":  # set-champion: the reason the api gave, as it is
        return f"checkpoint refused: {exc.message}"
    if exc.status_code == 409:
        return str(exc.message)
    if exc.status_code == 422 and exc.fields:
        return "invalid loop: " + "; ".join(f"{f['path']}: {f['message']}" for f in exc.fields)
    if exc.status_code == 422:
        return f"invalid loop: {exc.message}"
    return f"the api answered {exc.status_code} {exc.code}: {exc.message}"


def _print_json(value: BaseModel | list[BaseModel]) -> None:
    if isinstance(value, list):
        print(json.dumps([item.model_dump(mode="json") for item in value], indent=2))
    else:
        print(json.dumps(value.model_dump(mode="json"), indent=2))


def _create(args: argparse.Namespace) -> int:
    _check_secret_destination(args)
    created = _call(
        args,
        lambda client: client.create_loop(
            args.name,
            args.environment,
            executor=args.executor,
            budget_usd=args.budget_usd,
            changed_by=_actor(None),
        ),
    )
    written = _write_secret_file(args, created)
    if args.json:
        _print_created_json(args, created, written)
        return 0
    print(f"loop {created.name} created", end=" ")
    print(f"(environment {created.environment}, executor {created.executor})")
    _print_created(args, created, written)
    return 0


# What --secret-file holds: the new loop's credentials and where to use them.
_SECRET_FIELDS = ("signing_secret", "ingest_token")


def _check_secret_destination(args: argparse.Namespace) -> None:
    """Before a loop is created: its secrets, shown once, must have somewhere to go."""
    from services.cli import CliError

    if args.secret_file is None and not args.show_secrets:
        raise CliError(
            "a new loop's signing secret and ingest token are shown once: pass --secret-file "
            "PATH to write them to a new file (mode 0600), or --show-secrets to print them"
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


def _write_secret_file(args: argparse.Namespace, created: Any) -> Path | None:
    """Write the secrets to a new 0600 file; if that fails now, print them to stderr rather
    than lose them (the loop exists already)."""
    if args.secret_file is None:
        return None
    path = Path(args.secret_file)
    document = {
        "loop": created.name,
        "webhook_url": created.webhook_url,
        "otlp_traces_url": created.otlp_traces_url,
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


def _print_created_json(args: argparse.Namespace, created: Any, written: Path | None) -> None:
    document = created.model_dump(mode="json")
    if not args.show_secrets:
        for name in _SECRET_FIELDS:
            document.pop(name)
    if written is not None:
        document["secret_file"] = str(written)
    print(json.dumps(document, indent=2))


def _print_created(args: argparse.Namespace, created: Any, written: Path | None) -> None:
    print(f"webhook:        POST {created.webhook_url}")
    if args.show_secrets:
        print(f"signing secret: {created.signing_secret}")
    print(f"otlp endpoint:  POST {created.otlp_traces_url}")
    if args.show_secrets:
        print(f"ingest token:   {created.ingest_token}")
    if written is not None:
        print(f"signing secret and ingest token written to {written} (mode 0600)")
    print("they are not shown again (rotate with `ratchet loop rotate-secret`)")
    _print_warnings(created.warnings)


def _list(args: argparse.Namespace) -> int:
    loops = _call(args, lambda client: client.list_loops())
    if args.json:
        _print_json(loops)
        return 0
    if not loops:
        print("no loops yet: create one with `ratchet loop create NAME --env ENV`")
        return 0
    width = max(len(loop.name) for loop in loops)
    print(f"{'NAME':<{width}}  {'STATUS':<8}  {'ENVIRONMENT':<16}  EXECUTOR")
    for loop in loops:
        print(f"{loop.name:<{width}}  {loop.status:<8}  {loop.environment:<16}  {loop.executor}")
    return 0


def _show(args: argparse.Namespace) -> int:
    loop = _call(args, lambda client: client.get_loop(args.name))
    if args.json:
        _print_json(loop)
        return 0
    budget = f"${loop.budget_usd:,.2f}" if loop.budget_usd is not None else "none"
    print(
        f"loop {loop.name} ({loop.status}{': ' + loop.status_reason if loop.status_reason else ''})"
    )
    print(f"  environment  {loop.environment}")
    print(f"  executor     {loop.executor}")
    print(f"  budget       {budget}")
    print(f"  champion     {loop.champion_checkpoint_id or 'none yet'}")
    print(f"  config       version {loop.config_version} (`ratchet loop history {loop.name}`)")
    print(f"  traces       {loop.trace_count} (last {loop.last_trace_at or 'never'})")
    print(f"  webhook      {loop.webhook_url}")
    print(f"  otlp         {loop.otlp_traces_url}")
    for credential in loop.credentials:
        until = f"expires {credential.expires_at}" if credential.expires_at else "no expiry"
        print(f"  credential   {credential.kind} created {credential.created_at}, {until}")
    _print_curation(loop)
    _print_serving_ledger(_call(args, lambda client: client.serving_ledger(args.name)))
    return 0


def _print_serving_ledger(ledger: ServingLedgerPublic) -> None:
    """Both figures per champion, oldest first: what serving it cost per token beside what
    the cycle that produced it bought (services.loop.ledger says how they are computed)."""
    if not ledger.champions:
        return
    value = (
        f"${ledger.value_per_success_usd:g} per success"
        if ledger.value_per_success_usd is not None
        else "no value_per_success_usd: no break-even"
    )
    print(
        f"  serving      per champion, oldest first (${ledger.serving_hour_price_usd:g}/h; {value})"
    )
    print(
        f"    {'CHAMPION':<12}  {'TOKENS':>12}  {'CACHED':>10}  {'$/MTOK':>9}  {'LIVE':>6}  "
        f"{'HELD-OUT':>8}  {'$/POINT':>8}  {'BREAK-EVEN':>12}  SERVED"
    )
    for c in ledger.champions:
        until = "now" if c.ended_at is None else f"{c.ended_at:%Y-%m-%d %H:%M}"
        print(
            f"    {c.checkpoint_id[:12]:<12}  {c.tokens_served:>12,}  "
            f"{c.cached_prompt_tokens:>10,}  {_money(c.usd_per_mtok):>9}  "
            f"{_share(c.live_success_rate):>6}  {_share(c.heldout_pass_rate):>8}  "
            f"{_money(c.usd_per_heldout_point):>8}  "
            f"{_count(c.break_even_tokens):>12}  {c.started_at:%Y-%m-%d %H:%M} to {until}"
        )


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.4f}" if 0 < abs(value) < 0.01 else f"${value:,.2f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _print_curation(loop: Any) -> None:
    """What curation made of the loop's traces, by outcome and reason, with an example each:
    why traces did (or did not) become tasks, and the command that shows one."""
    if not loop.curation:
        return
    print("  curation     traces by outcome and reason (example trace)")
    for count in loop.curation:
        what = count.outcome + (f" {count.reason}" if count.reason else "")
        print(f"    {count.count:>8}  {what}  (e.g. {count.example_external_id})")
    print(f"  see one with `ratchet traces show ID --loop {loop.name}`")


def _rotate(args: argparse.Namespace) -> int:
    kind = "ingest_token" if args.ingest_token else "signing_secret"
    rotated = _call(
        args,
        lambda client: client.rotate_secret(args.name, grace_seconds=args.grace_seconds, kind=kind),
    )
    if args.json:
        _print_json(rotated)
        return 0
    label = "ingest token" if kind == "ingest_token" else "signing secret"
    print(f"new {label} for {rotated.loop}: {rotated.secret}")
    if rotated.previous_expires_at is not None:
        print(f"the previous one keeps working until {rotated.previous_expires_at}")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = _call(args, lambda client: client.status(args.name))
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"loop {status['loop']}: {status['db_status']}", end="")
    print(f" ({status['status_reason']})" if status.get("status_reason") else "")
    print(
        f"  workflow     {status['workflow_id']} {status.get('workflow_status') or 'not started'}"
    )
    if status.get("stage"):
        print(f"  stage        {status['stage']} (cycle {status.get('cycle')})")
        print(f"  waiting for  {status.get('waiting_for') or '-'}")
        print(f"  last outcome {status.get('last_outcome') or '-'}")
        print(f"  cycles done  {status.get('cycles_done')}")
    rollback = status.get("last_rollback")
    if rollback:
        print(f"  rollback     {rollback['status']} {rollback['decided_at']}: {rollback['reason']}")
    return 0


def _set_champion(args: argparse.Namespace) -> int:
    result = _call(
        args, lambda client: client.set_champion(args.name, args.checkpoint, reason=args.reason)
    )
    print(f"champion of {args.name}: {result['checkpoint_id']} ({result['uri']})")
    return 0


def _start(args: argparse.Namespace) -> int:
    result = _call(args, lambda client: client.start_loop(args.name))
    print(f"workflow {result['workflow_id']} is running")
    return 0


def _action(args: argparse.Namespace) -> int:
    result = _call(
        args,
        lambda client: client.action(
            args.name,
            args.action,
            reason=args.reason,
            by=getattr(args, "by", None),
            cycle=getattr(args, "cycle", 0),
        ),
    )
    print(f"{args.action}: {result['status']} ({result['workflow_id']})")
    return 0


def _actor(given: str | None) -> str:
    if given:
        return given
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _apply(args: argparse.Namespace) -> int:
    """Create the loop the file declares, or change the existing one to match it: a policy the
    file leaves out returns to its defaults. Each change is a new version in the loop's
    history and applies from its next cycle.
    """
    from services.cli import CliError
    from services.loop.manifest import LoopFileError, read_loop_file

    try:
        manifest = read_loop_file(args.file)
    except LoopFileError as exc:
        raise CliError(str(exc)) from None
    args.name = manifest.name
    by = _actor(args.by)
    existing = _call(args, lambda client: _find_loop(client, manifest.name))
    if existing is None:
        return _apply_create(args, manifest, by)
    current = _document(existing)
    patch = {**manifest.patch_for(current), "changed_by": by}
    if args.reason:
        patch["reason"] = args.reason
    change = _call(
        args, lambda client: client.patch_loop(manifest.name, patch, dry_run=args.dry_run)
    )
    if args.json:
        _print_json(change)
        return 0
    _print_changes(change.changes)
    _print_warnings(change.warnings)
    if not change.changed:
        print(f"loop {manifest.name} unchanged (version {change.version})")
    elif args.dry_run:
        print(f"loop {manifest.name} would change (dry run; still version {change.version})")
    else:
        print(
            f"loop {manifest.name} configured: version {change.version} "
            "(applies from the next cycle; a running cycle keeps its settings)"
        )
    return 0


def _find_loop(client: Any, name: str) -> Any:
    from services.client import ApiRequestError

    try:
        return client.get_loop(name)
    except ApiRequestError as exc:
        if exc.status_code == 404:
            return None
        raise


def _document(loop: Any) -> dict[str, Any]:
    from services.loop.config import CONFIG_KEYS

    return {key: getattr(loop, key) for key in CONFIG_KEYS}


def _apply_create(args: argparse.Namespace, manifest: Any, by: str) -> int:
    from services.cli import CliError
    from services.loop.config import diff

    if args.dry_run:
        from pydantic import ValidationError

        from services.api.schemas.loops import LoopCreate

        try:
            LoopCreate.model_validate(
                {"name": manifest.name, "environment": manifest.environment, **manifest.settings}
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise CliError(f"invalid loop: {problems}", exit_code=1) from None
        document = {"environment": manifest.environment, **manifest.create_arguments()}
        if args.json:
            print(json.dumps({"loop": manifest.name, "dry_run": True, "create": document}))
            return 0
        _print_changes(diff({}, document))
        print(f"loop {manifest.name} would be created (dry run)")
        return 0
    _check_secret_destination(args)
    created = _call(
        args,
        lambda client: client.create_loop(
            manifest.name,
            manifest.environment,
            changed_by=by,
            **{"executor": None, **manifest.create_arguments()},
        ),
    )
    written = _write_secret_file(args, created)
    if args.json:
        _print_created_json(args, created, written)
        return 0
    print(f"loop {created.name} created from {args.file} (version 1)")
    _print_created(args, created, written)
    return 0


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"warning: {warning}")


def _print_changes(changes: Any) -> None:
    from services.loop.config import Change, render_diff

    items = [c if isinstance(c, Change) else Change(c.path, c.before, c.after) for c in changes]
    for line in render_diff(items):
        print(line)


def _history(args: argparse.Namespace) -> int:
    versions = _call(args, lambda client: client.config_versions(args.name, limit=args.limit))
    if args.json:
        _print_json(versions)
        return 0
    for version in versions:
        when = version.created_at.isoformat(timespec="seconds")
        why = f" ({version.reason})" if version.reason else ""
        print(f"version {version.version}  {when}  by {version.changed_by}{why}")
        _print_changes(version.changes)
    return 0


def _export(args: argparse.Namespace) -> int:
    from services.loop.manifest import to_loop_file

    loop = _call(args, lambda client: client.get_loop(args.name))
    print(to_loop_file(loop.name, _document(loop)), end="")
    return 0
