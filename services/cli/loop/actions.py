"""``ratchet loop set-champion|start|pause|resume|run-now|approve|reject|rollback``: what an
operator does to a running loop (the api signals its workflow)."""

from __future__ import annotations

import argparse
from typing import Any

from services.cli.loop.parsing import call, loop_command

ACTIONS = {
    "pause": "pause the loop: no new cycle starts",
    "resume": "resume a paused loop",
    "run-now": "start a cycle now, without waiting for a trigger (refused while the loop has "
    "no champion to train from)",
    "approve": "approve the candidate waiting at a manual gate",
    "reject": "reject the candidate waiting at a manual gate",
    "rollback": "roll back to the champion before the last promotion",
}


def register(commands: Any) -> None:
    """``loop set-champion``, ``loop start`` and the operator's signals."""
    champion = loop_command(
        commands,
        "set-champion",
        _set_champion,
        help="register a checkpoint directory as the loop's champion (e.g. the first one)",
    )
    champion.add_argument("checkpoint", help="checkpoint directory (path or file:// URI)")
    champion.add_argument("--reason", default=None)

    loop_command(commands, "start", _start, help="start the loop's workflow (idempotent)")

    for action, help_text in ACTIONS.items():
        command = loop_command(commands, action, _action, help=help_text)
        command.add_argument("--reason", default=None, help="recorded with the action")
        if action in ("approve", "reject"):
            command.add_argument("--cycle", type=int, default=0, help="cycle (default: current)")
            command.add_argument("--by", default=None, help="who decides (default: operator)")
        command.set_defaults(action=action)


def _set_champion(args: argparse.Namespace) -> int:
    result = call(
        lambda client: client.set_champion(args.name, args.checkpoint, reason=args.reason)
    )
    print(f"champion of {args.name}: {result['checkpoint_id']} ({result['uri']})")
    return 0


def _start(args: argparse.Namespace) -> int:
    result = call(lambda client: client.start_loop(args.name))
    print(f"workflow {result['workflow_id']} is running")
    return 0


def _action(args: argparse.Namespace) -> int:
    result = call(
        lambda client: client.action(
            args.name,
            args.action,
            reason=args.reason,
            by=getattr(args, "by", None),
            cycle=getattr(args, "cycle", 0),
        ),
    )
    print(f"{args.action}: {result['status']} ({result['workflow_id']})")
    if result.get("note"):
        print(f"note: {result['note']}")
    return 0
