"""``ratchet loop bootstrap NAME``: a first champion from the loop's own successful traces.

Prints what the bootstrap learns from (the traces it saw, the successes it uses, the ones it
leaves out and why) and where to follow it; the api signals the loop, which runs the
bootstrap as a cycle (docs/loops.md, "A first champion by bootstrap").
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.cli.loop.parsing import loop_command

DESCRIPTION = """\
Train a first champion for a loop that has none: an SFT-LoRA adapter over the loop's base
model, on the conversations (tool calls and results included) of its successful traces of
the train split only; never a failure, never a trace of an eval, held-out or regression
task or cluster. The adapter and the base model are evaluated on the loop's frozen held-out
set and the adapter is proposed through the gate (paired test, the policy's confidence)
with the base model as the baseline: an auto gate promotes it on a win, a manual gate waits
for `ratchet loop approve`. Runs as a cycle with trigger `bootstrap`; a replay loop of the
hf family only. The base model: --base, else training_profile.base_checkpoint.
"""


def register(commands: Any) -> None:
    parser = loop_command(
        commands,
        "bootstrap",
        _bootstrap,
        help="train a first champion from the loop's successful traces (SFT-LoRA on the base "
        "model, judged on the held-out set)",
    )
    parser.description = DESCRIPTION
    parser.add_argument(
        "--base",
        default=None,
        metavar="CHECKPOINT",
        help="the base model: a checkpoint id of the store (`ratchet models import DIR` "
        "prints it) or a model directory; default: training_profile.base_checkpoint",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="bootstrap a loop that has a champion: on promotion the adapter replaces it "
        "(`ratchet loop rollback` restores it)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say what it would learn from; start nothing"
    )
    parser.add_argument("--reason", default=None, help="recorded with the cycle")
    parser.add_argument("--json", action="store_true", help="print the api's answer as JSON")


def _bootstrap(args: argparse.Namespace) -> int:
    from services.cli.common import call_api

    result = call_api(
        lambda client: client.bootstrap(
            args.name, base=args.base, force=args.force, dry_run=args.dry_run, reason=args.reason
        )
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for line in report_lines(result):
        print(line)
    return 0


def report_lines(result: dict[str, Any]) -> list[str]:
    """What a person reads: the traces seen, used and left out, the gate, what happens next."""
    loop, report = result["loop"], result["report"]
    lines = [
        f"bootstrap of loop {loop} over base model {result['base_checkpoint_id'][:12]}",
        f"  traces seen: {report['traces']}"
        + (" (the newest; older ones not scanned)" if report["truncated"] else ""),
        f"  successes: {report['successes']}; failures: {report['failures']} (never used); "
        f"without an outcome: {report['no_outcome']}",
        f"  successes used (train split): {report['used']}",
    ]
    left = report["left_out"]
    lines.append(f"  successes left out: {sum(left.values())}")
    lines += [f"    {reason.replace('_', ' ')}: {n}" for reason, n in left.items()]
    lines.append(
        f"  judged against the base model on {result['heldout_tasks']} held-out tasks, "
        "through the gate"
    )
    if result["status"] == "dry_run":
        lines.append("dry run: nothing started")
        return lines
    if result.get("note"):
        lines.append(f"note: {result['note']}")
    lines.append(
        f"signalled {result['workflow_id']}: the bootstrap cycle starts at the loop's next "
        f"trigger check; follow it with `ratchet loop status {loop}` or the loop page "
        "(a manual gate waits for `ratchet loop approve`)"
    )
    return lines
