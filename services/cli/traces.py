"""``ratchet traces list|show``: a loop's traces and what curation made of each.

Every rejection explained: ``list`` shows each trace's curation outcome (task, duplicate,
rejected, skipped, pending) and reason, filtered like ``GET /v1/loops/{loop}/traces``;
``show`` shows one trace's verdict, the tasks it became and its feedback. Both go through
the admin API (services.client), as ``ratchet loop`` does; ``--json`` prints what the API
answered.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from services.argtypes import positive_int
from services.cli.common import (
    add_command,
    add_loop_argument,
    call_api,
    command_group,
    loop_name,
)
from services.cli.tasks import check_text

CURATION_OUTCOMES = ("pending", "task", "duplicate", "rejected", "skipped")
REPORTED_OUTCOMES = ("success", "failure", "unknown")


def _timestamp(raw: str) -> dt.datetime:
    """An argparse type: an ISO 8601 time; without a zone it is UTC."""
    try:
        value = dt.datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not an ISO 8601 time, e.g. 2026-12-02T14:00:00Z"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def register(subparsers: Any) -> None:
    commands = command_group(
        subparsers, "traces", help="a loop's traces: curation outcome and reason of each"
    )
    listing = add_command(
        commands, "list", _list, help="list a loop's traces, newest first, with their verdicts"
    )
    add_loop_argument(listing, positional=True)
    listing.add_argument("--outcome", choices=REPORTED_OUTCOMES, help="what the agent reported")
    listing.add_argument("--curation", choices=CURATION_OUTCOMES, help="what curation made of it")
    listing.add_argument(
        "--reason",
        help="reason code of a rejection or a skip, e.g. no_tools (one that no trace has lists "
        "the loop's reasons)",
    )
    listing.add_argument("--since", type=_timestamp, help="received at or after (ISO 8601)")
    listing.add_argument("--until", type=_timestamp, help="received before (ISO 8601)")
    listing.add_argument("--limit", type=positive_int, default=50, help="traces per page")
    listing.add_argument("--cursor", help="next_cursor of a previous page")
    listing.add_argument("--json", action="store_true", help="print the page as JSON")
    show = add_command(
        commands, "show", _show, help="one trace: verdict, reason, tasks it became, feedback"
    )
    show.add_argument("external_id", help="the trace's external_id")
    add_loop_argument(show, positional=False)
    show.add_argument("--body", action="store_true", help="also print the stored trace")
    show.add_argument("--json", action="store_true", help="print JSON")


def _list(args: argparse.Namespace) -> int:
    """List a loop's traces, newest first: what the agent reported, what curation made of
    each and why (the reason of a rejection or a skip), and what its task's reward checks
    (the facts an answer must state). Pages with --cursor."""
    name = loop_name(args)
    page = call_api(
        lambda client: client.list_traces(
            name,
            outcome=args.outcome,
            curation=args.curation,
            reason=args.reason,
            since=args.since,
            until=args.until,
            cursor=args.cursor,
            limit=min(args.limit, 500),
        )
    )
    if args.json:
        print(json.dumps(page.model_dump(mode="json"), indent=2))
        return 0
    if not page.traces:
        print(f"loop {name!r} has no traces that match")
        if args.reason:
            _print_known_reasons(name, args.reason)
        return 0
    width = max(12, *(len(t.external_id) for t in page.traces))
    print(f"{'EXTERNAL ID':<{width}}  {'OUTCOME':<8} {'CURATION':<10} {'RECEIVED':<20} REASON")
    for trace in page.traces:
        received = trace.received_at.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{trace.external_id:<{width}}  {trace.outcome:<8} {trace.curation_outcome:<10} "
            f"{received:<20} {trace.reason or '-'}"
        )
        if trace.check is not None:
            print(f"{'':<{width}}  checks {check_text(trace.check)}")
    if page.next_cursor:
        print(f"more: ratchet traces list --loop {name} --cursor {page.next_cursor}")
    return 0


def _print_known_reasons(name: str, given: str) -> None:
    """After a ``--reason`` that matched nothing: the reasons the loop's traces do have, so
    a mistyped code is seen as one (reason codes come from the loop's environment)."""
    loop = call_api(lambda client: client.get_loop(name))
    reasons: dict[str, int] = {}
    for count in loop.curation:
        if count.reason:
            reasons[count.reason] = reasons.get(count.reason, 0) + count.count
    if given in reasons:
        return  # a real reason, outside the other filters
    if not reasons:
        print(f"no trace of loop {name!r} has a reason yet (`ratchet loop show {name}`)")
        return
    listed = ", ".join(f"{reason} ({n})" for reason, n in sorted(reasons.items()))
    print(f"no trace of loop {name!r} has reason {given!r}; the reasons its traces have: {listed}")


def _show(args: argparse.Namespace) -> int:
    """One trace of a loop: what the agent reported, curation's verdict in full, what its
    task checks, the tasks it became (or was counted into) and the feedback it got."""
    name = loop_name(args)
    trace = call_api(lambda client: client.get_trace(name, args.external_id))
    if args.json:
        shown = trace.model_dump(mode="json")
        if not args.body:
            shown.pop("body")
        print(json.dumps(shown, indent=2))
        return 0
    print(f"trace {trace.external_id} of loop {name}")
    print(
        f"  reported     {trace.outcome} (success {trace.success}, score {trace.score}, "
        f"error {trace.error_kind or '-'})"
    )
    print(f"  model        {trace.model_version or '-'}")
    print(f"  received     {trace.received_at}")
    print(
        f"  curation     {trace.curation_outcome}" + (f" ({trace.reason})" if trace.reason else "")
    )
    if trace.curation_detail:
        print(f"  detail       {trace.curation_detail}")
    if trace.check is not None:
        print(f"  checks       {check_text(trace.check)}")
    for task in trace.tasks:
        print(
            f"  task         {task.task_id} ({task.relation}, {task.split}, {task.environment}); "
            f"`ratchet tasks show {task.task_id}`"
        )
    for feedback in trace.feedback:
        said = ", ".join(
            f"{key} {value!r}"
            for key, value in (
                ("score", feedback.score),
                ("label", feedback.label),
                ("correction", feedback.correction),
                ("comment", feedback.comment),
            )
            if value is not None
        )
        print(f"  feedback     {feedback.created_at}: {said}")
    if args.body:
        print(json.dumps(trace.body, indent=2))
    return 0
