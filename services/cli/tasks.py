"""``ratchet tasks list|show|pin``: the curated RL tasks of a loop.

Read-mostly views of what curation produced, for operators: which tasks a loop has and
where a task came from (its traces); ``--json`` prints machine-readable output for scripts.
``tasks pin`` moves tasks into the loop's pinned regression suite (never trained on).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.cli import CliError
from services.cli.common import (
    add_command,
    add_loop_argument,
    command_group,
    database_session,
    loop_name,
    loop_named,
    positive_int,
    print_json,
)
from services.cli.listing import Listing, row_summary
from services.db.models import Task
from services.db.queries import tasks as q

SPLITS = ("train", "eval", "heldout", "regression")


def register(subparsers: Any) -> None:
    commands = command_group(subparsers, "tasks", help="curated RL tasks of a loop")
    listing = add_command(commands, "list", _tasks_list, help="list a loop's tasks, newest first")
    add_loop_argument(listing, positional=True)
    listing.add_argument("--split", choices=SPLITS, help="only tasks of this split")
    listing.add_argument("--limit", type=positive_int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
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


TASK_COLUMNS = (
    "id",
    "split",
    "origin",
    "weight",
    "pinned",
    "cluster_id",
    "content_hash",
    "probe_pass_rate",
    "redactions",
    "created_at",
)


def _task_line(task: Task) -> str:
    prompt = " ".join(str(task.spec.get("prompt", "")).split())[:60]
    return (
        f"{task.id:>8}  {task.split:<10} {task.origin:<8} {task.weight:>6}  "
        f"{task.cluster_id[:12]:<12}  {prompt}"
    )


TASKS = Listing(
    noun="tasks",
    columns=TASK_COLUMNS,
    header=f"{'ID':>8}  {'SPLIT':<10} {'ORIGIN':<8} {'WEIGHT':>6}  {'CLUSTER':<12}  PROMPT",
    line=_task_line,
)


def _tasks_list(args: argparse.Namespace) -> int:
    return TASKS.list_for_loop(
        args,
        lambda session, loop: q.list_tasks(
            session=session, loop_id=loop.id, split=args.split, limit=args.limit
        ),
    )


def _tasks_show(args: argparse.Namespace) -> int:
    with database_session() as session:
        task = q.get_task(session=session, task_id=args.task_id)
        if task is None:
            raise CliError(f"no task {args.task_id}", exit_code=1)
        sources = q.task_sources(session=session, task_id=task.id)
        detail = {
            **row_summary(task, TASK_COLUMNS),
            "failure_signature": task.failure_signature,
            "spec": task.spec,
            "sources": [{"trace_id": t, "external_id": e, "relation": r} for t, e, r in sources],
        }
        if args.json:
            print_json(detail)
            return 0
        for key in ("id", "split", "origin", "weight", "pinned", "cluster_id", "content_hash"):
            print(f"{key:<18}{detail[key]}")
        print(f"{'probe_pass_rate':<18}{detail['probe_pass_rate']}")
        print(f"{'failure':<18}{detail['failure_signature']}")
        print(f"{'redactions':<18}{json.dumps(detail['redactions'], sort_keys=True)}")
        print(f"{'verifier':<18}{json.dumps(task.spec.get('verifier'), sort_keys=True)}")
        print("prompt:")
        print("  " + str(task.spec.get("prompt", "")).replace("\n", "\n  "))
        print(f"sources ({len(sources)}):")
        for trace_id, external_id, relation in sources:
            print(f"  trace {trace_id:<8} {relation:<15} {external_id}")
    return 0


def _tasks_pin(args: argparse.Namespace) -> int:
    with database_session() as session:
        loop = loop_named(session, loop_name(args))
        pinned = q.pin_tasks(session=session, loop_id=loop.id, task_ids=args.task_ids)
        refused = sorted(set(args.task_ids) - set(pinned))
        if refused:  # raising rolls the whole pin back
            raise CliError(
                f"tasks {', '.join(map(str, refused))} are not tasks of loop {loop.name!r} or are "
                "held out (the held-out set is frozen); nothing was pinned",
                exit_code=1,
            )
    print(f"pinned {len(pinned)} task(s) to the regression suite of {loop_name(args)}")
    return 0
