"""``ratchet tasks list|show|pin|restore``: the curated RL tasks of a loop.

Read-mostly views of what curation produced, for operators: which tasks a loop has and
where a task came from (its traces); ``--json`` prints what the admin API answered, for
scripts. ``tasks pin`` moves tasks into the loop's pinned regression suite (never trained
on). A task the worker set aside (every episode needed a tool result nobody could give) is
marked ``aside`` in the listing and shown with its reason; ``tasks restore`` brings it back.
Every command goes through the admin API (services.client), as ``ratchet loop`` does.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.api.schemas.tasks import RewardCheckPublic, TaskPublic
from services.argtypes import positive_int
from services.cli.common import (
    add_command,
    add_loop_argument,
    call_api,
    command_group,
    loop_name,
    print_json,
)
from services.cli.listing import Listing

SPLITS = ("train", "eval", "heldout", "regression")


def register(subparsers: Any) -> None:
    commands = command_group(subparsers, "tasks", help="curated RL tasks of a loop")
    listing = add_command(commands, "list", _tasks_list, help="list a loop's tasks, newest first")
    add_loop_argument(listing, positional=True)
    listing.add_argument("--split", choices=SPLITS, help="only tasks of this split")
    listing.add_argument(
        "--set-aside", action="store_true", help="only tasks set aside (never trained on)"
    )
    listing.add_argument("--limit", type=positive_int, default=50, help="tasks per page")
    listing.add_argument("--cursor", help="next_cursor of a previous page")
    listing.add_argument("--json", action="store_true", help="print the page as JSON")
    show = add_command(
        commands, "show", _tasks_show, help="one task: spec, cluster, split, source traces"
    )
    show.add_argument("task_id", type=positive_int)
    show.add_argument("--json", action="store_true", help="print JSON")
    pin = add_command(
        commands, "pin", _tasks_pin, help="put tasks into the loop's pinned regression suite"
    )
    add_loop_argument(pin, positional=False)
    pin.add_argument("task_ids", type=positive_int, nargs="+")
    restore = add_command(
        commands, "restore", _tasks_restore, help="bring set-aside tasks back into training"
    )
    add_loop_argument(restore, positional=False)
    restore.add_argument("task_ids", type=positive_int, nargs="+")


def check_text(check: RewardCheckPublic) -> str:
    """What a reward checks, in one line: the rule, each fact in its normal form (with the
    reference's own spelling where it differs), and the judge's part."""
    if check.rule == "judge":
        return f"judge {check.judge} decides"
    parts = []
    for fact in check.facts:
        spelled = "" if fact.text.casefold() == fact.value.casefold() else f" ({fact.text})"
        parts.append(f"{fact.kind} {fact.value}{spelled}")
    line = check.rule + (": " + " · ".join(parts) if parts else "")
    if check.judge:
        line += f"; judge {check.judge} compared on a sample"
    return line


def _task_line(task: TaskPublic) -> str:
    prompt = " ".join(task.prompt.split())[:60]
    split = f"{task.split} aside" if task.set_aside_reason else task.split
    return (
        f"{task.id:>8}  {split:<16} {task.origin:<8} {task.weight:>6}  "
        f"{task.cluster_id[:12]:<12}  {prompt}"
    )


TASKS = Listing(
    noun="tasks",
    command="tasks list",
    header=f"{'ID':>8}  {'SPLIT':<16} {'ORIGIN':<8} {'WEIGHT':>6}  {'CLUSTER':<12}  PROMPT",
    line=_task_line,
)


def _tasks_list(args: argparse.Namespace) -> int:
    """List a loop's curated tasks, newest first (a page at a time: --cursor)."""
    name = loop_name(args)
    page = call_api(
        lambda client: client.list_tasks(
            name,
            split=args.split,
            set_aside=True if args.set_aside else None,
            cursor=args.cursor,
            limit=min(args.limit, 500),
        )
    )
    TASKS.print_page(page, page.tasks, page.next_cursor, loop=name, as_json=args.json)
    return 0


def _tasks_show(args: argparse.Namespace) -> int:
    """One task: where it sits (split, cluster, weight), what redaction removed, its
    verifier (and for a replay task what it checks: the facts an answer must state) and
    prompt, and the traces it came from."""
    task = call_api(lambda client: client.get_task(args.task_id))
    if args.json:
        print_json(task.model_dump(mode="json"))
        return 0
    print(f"{'loop':<18}{task.loop}")
    for key in ("id", "split", "origin", "weight", "pinned", "cluster_id", "content_hash"):
        print(f"{key:<18}{getattr(task, key)}")
    print(f"{'probe_pass_rate':<18}{task.probe_pass_rate}")
    if task.set_aside_reason:
        print(f"{'set_aside':<18}{task.set_aside_reason} ({task.set_aside_at}): never trained on")
        print(f"{'':<18}{task.set_aside_detail}")
        print(f"{'':<18}bring it back: ratchet tasks restore --loop {task.loop} {task.id}")
    print(f"{'failure':<18}{task.failure_signature}")
    print(f"{'redactions':<18}{json.dumps(task.redactions, sort_keys=True)}")
    print(f"{'verifier':<18}{json.dumps(task.spec.get('verifier'), sort_keys=True)}")
    if task.check is not None:
        print(f"{'checks':<18}{check_text(task.check)}")
    print("prompt:")
    print("  " + task.prompt.replace("\n", "\n  "))
    print(f"sources ({len(task.sources)}):")
    for source in task.sources:
        print(f"  trace {source.trace_id:<8} {source.relation:<15} {source.external_id}")
    return 0


def _tasks_pin(args: argparse.Namespace) -> int:
    """Pin tasks into the loop's regression suite: every task of every dataset from now on,
    never trained on. All the tasks given, or (when one is not the loop's, or is held out)
    none."""
    name = loop_name(args)
    result = call_api(lambda client: client.pin_tasks(name, args.task_ids))
    print(f"pinned {len(result.pinned)} task(s) to the regression suite of {result.loop}")
    return 0


def _tasks_restore(args: argparse.Namespace) -> int:
    """Bring set-aside tasks back: the next snapshot may train on them again (e.g. once the
    tool they needed is allow-listed). All the tasks given, or (when one is not the loop's)
    none."""
    name = loop_name(args)
    result = call_api(lambda client: client.restore_tasks(name, args.task_ids))
    print(f"restored {len(result.restored)} set-aside task(s) of {result.loop}")
    return 0
