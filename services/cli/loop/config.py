"""``ratchet loop apply|history|export``: a loop's configuration as a file, like kubectl.

``apply`` creates the loop a file declares or changes the existing one to match it (each
change a new version in the loop's history); ``history`` lists the versions; ``export``
prints the configuration as a loop file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.argtypes import positive_int
from services.cli.common import actor, add_command
from services.cli.loop.credentials import (
    add_secret_options,
    check_secret_destination,
    print_created,
    print_created_json,
    write_secret_file,
)
from services.cli.loop.parsing import call, loop_command, print_changes, print_model, print_warnings


def register(commands: Any) -> None:
    """``loop apply``, ``loop history`` and ``loop export``."""
    apply = add_command(
        commands,
        "apply",
        _apply,
        help="create or update a loop from a loop file (like kubectl apply); --dry-run shows "
        "the diff",
    )
    apply.add_argument("-f", "--file", required=True, help="loop file (YAML or JSON)")
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="make every check the apply would (on the api) and print the diff; change nothing",
    )
    apply.add_argument("--by", default=None, help="who makes the change (default: user@host)")
    apply.add_argument("--reason", default=None, help="why, kept in the loop's history")
    apply.add_argument("--json", action="store_true", help="print one JSON object")
    add_secret_options(apply, creating="when the file creates the loop: ")

    history = loop_command(
        commands,
        "history",
        _history,
        help="the loop's configuration versions: who changed what, when",
    )
    history.add_argument("--limit", type=positive_int, default=20, help="newest versions to show")
    history.add_argument("--json", action="store_true", help="print a JSON array")

    loop_command(
        commands,
        "export",
        _export,
        help="print the loop's configuration as a loop file for `ratchet loop apply`",
    )


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
    by = actor(args.by)
    existing = call(lambda client: _find_loop(client, manifest.name))
    if existing is None:
        return _apply_create(args, manifest, by)
    current = _document(existing)
    patch = {**manifest.patch_for(current), "changed_by": by}
    if args.reason:
        patch["reason"] = args.reason
    change = call(lambda client: client.patch_loop(manifest.name, patch, dry_run=args.dry_run))
    if args.json:
        print_model(change)
        return 0
    print_changes(change.changes)
    print_warnings(change.warnings)
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
    """The loop's settings as a loop file holds them: a policy as what differs from its
    defaults (the api returns each policy whole, its defaults filled in)."""
    from pydantic import BaseModel

    from services.loop.config import CONFIG_KEYS

    def plain(value: Any) -> Any:
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", exclude_defaults=True)
        return value

    return {key: plain(getattr(loop, key)) for key in CONFIG_KEYS}


def _apply_create(args: argparse.Namespace, manifest: Any, by: str) -> int:
    from services.client import LoopPolicies
    from services.loop.config import diff

    arguments = manifest.create_arguments()
    if args.dry_run:
        # The api makes every check the creation would (environment, endpoints, policies,
        # the name), so a dry run fails where the real apply would, saying the same.
        checked = call(
            lambda client: client.check_new_loop(
                manifest.name,
                manifest.environment,
                executor=arguments.get("executor"),
                budget_usd=arguments.get("budget_usd"),
                policies=LoopPolicies.of(arguments),
            )
        )
        document = {"environment": manifest.environment, **arguments}
        if args.json:
            print(
                json.dumps(
                    {
                        "loop": manifest.name,
                        "dry_run": True,
                        "create": document,
                        "warnings": checked.warnings,
                    }
                )
            )
            return 0
        print_changes(diff({}, document))
        print_warnings(checked.warnings)
        print(f"loop {manifest.name} would be created (dry run)")
        return 0
    check_secret_destination(args)
    created = call(
        lambda client: client.create_loop(
            manifest.name,
            manifest.environment,
            executor=arguments.get("executor"),
            budget_usd=arguments.get("budget_usd"),
            policies=LoopPolicies.of(arguments),
            changed_by=by,
        ),
    )
    written = write_secret_file(args, created)
    if args.json:
        print_created_json(args, created, written)
        return 0
    print(f"loop {created.name} created from {args.file} (version 1)")
    print_created(args, created, written)
    return 0


def _history(args: argparse.Namespace) -> int:
    versions = call(lambda client: client.config_versions(args.name, limit=args.limit))
    if args.json:
        print_model(versions)
        return 0
    for version in versions:
        when = version.created_at.isoformat(timespec="seconds")
        why = f" ({version.reason})" if version.reason else ""
        print(f"version {version.version}  {when}  by {version.changed_by}{why}")
        print_changes(version.changes)
    return 0


def _export(args: argparse.Namespace) -> int:
    from services.loop.manifest import to_loop_file

    loop = call(lambda client: client.get_loop(args.name))
    print(to_loop_file(loop.name, _document(loop)), end="")
    return 0
