"""``ratchet loop list|show|status|tools``: the loops, one loop's traffic, credentials,
curation and serving ledger, its live status, and a replay loop's live tools."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from services.api.schemas.loops import NextCyclePublic
from services.cli.common import add_command
from services.cli.loop.parsing import call, loop_command, print_model
from services.evaluation.figures import Gain

if TYPE_CHECKING:
    from services.api.schemas.ledger import ServingLedgerPublic
    from services.api.schemas.loops import CycleFiguresPublic, GainPublic


def register(commands: Any) -> None:
    """``loop list``, ``loop show`` and ``loop status``."""
    listing = add_command(commands, "list", _list, help="list loops")
    listing.add_argument("--json", action="store_true", help="print a JSON array")

    show = loop_command(
        commands,
        "show",
        _show,
        help="show a loop, its traffic, credentials, curation counts and what its next cycle "
        "waits for",
    )
    show.add_argument("--json", action="store_true", help="print one JSON object")

    status = loop_command(
        commands, "status", _status, help="the loop's stage, cycle and what it waits for"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")

    tools = loop_command(
        commands,
        "tools",
        _tools,
        help="a replay loop's live tool endpoint: the tools it may ask, what the server lists",
    )
    tools.add_argument("--json", action="store_true", help="print one JSON object")


def _list(args: argparse.Namespace) -> int:
    loops = call(lambda client: client.list_loops())
    if args.json:
        print_model(loops)
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
    loop = call(lambda client: client.get_loop(args.name))
    if args.json:
        print_model(loop)
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
    _print_next_cycle(loop.next_cycle)
    _print_cycles(loop.cycles)
    _print_serving_ledger(call(lambda client: client.serving_ledger(args.name)))
    return 0


def _print_next_cycle(next_cycle: NextCyclePublic | None) -> None:
    """What the next cycle waits for, one line each with what to do, and when the traces
    not curated yet will be (services.loop.next_cycle words them)."""
    if next_cycle is None:  # an api from before the field
        return
    if next_cycle.waits_for:
        print("  next cycle   waits for")
        for line in next_cycle.waits_for:
            print(f"    - {line}")
    else:
        print(f"  next cycle   waits for {next_cycle.summary}")
    if next_cycle.curation:
        print(f"  pending      {next_cycle.curation}")


def _print_cycles(cycles: list[CycleFiguresPublic]) -> None:
    """The latest cycles' three numbers, each with its 95 % interval and what it counted
    (held-out and gate: tasks, paired bootstrap; live: traces before and after, Newcombe)."""
    if not cycles:
        return
    print("  cycles       newest first: points with 95% intervals and counts")
    for cycle in cycles:
        numbers = " · ".join(
            f"{name} {_gain(figure)}"
            for name, figure in (
                ("held-out", cycle.heldout),
                ("gate", cycle.gate),
                ("live", cycle.live),
            )
            if figure is not None
        )
        kept = "" if not cycle.points_gained else f", {cycle.points_gained:+.1f} gained"
        print(f"    {cycle.number:>4}  {cycle.outcome or 'running':<12} {numbers or '-'}{kept}")


def _gain(figure: GainPublic) -> str:
    """The API's figure as every report prints it (services.evaluation.figures)."""
    low, high = figure.ci95_points
    if figure.method == "newcombe":
        return Gain(figure.points, low, high, figure.n, "newcombe", figure.n_before).text()
    return Gain(figure.points, low, high, figure.n).text()


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
        f"    {'CHAMPION':<12}  {'TOKENS':>12}  {'CACHED':>10}  {'$/MTOK':>9}  {'LIVE':>22}  "
        f"{'HELD-OUT':>24}  {'$/POINT':>8}  {'BREAK-EVEN':>12}  SERVED"
    )
    for c in ledger.champions:
        until = "now" if c.ended_at is None else f"{c.ended_at:%Y-%m-%d %H:%M}"
        live = _rate(c.live_success_rate, c.live_ci95, f"{c.live_successes}/{c.live_episodes}")
        heldout = _rate(c.heldout_pass_rate, c.heldout_ci95, f"{c.heldout_tasks} tasks")
        print(
            f"    {c.checkpoint_id[:12]:<12}  {c.tokens_served:>12,}  "
            f"{c.cached_prompt_tokens:>10,}  {_money(c.usd_per_mtok):>9}  "
            f"{live:>22}  {heldout:>24}  "
            f"{_money(c.usd_per_heldout_point):>8}  "
            f"{_count(c.break_even_tokens):>12}  {c.started_at:%Y-%m-%d %H:%M} to {until}"
        )


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.4f}" if 0 < abs(value) < 0.01 else f"${value:,.2f}"


def _rate(value: float | None, interval: list[float] | None, counted: str) -> str:
    """``67% [55, 77] 40/60``: a rate with its 95 % interval and what it counted."""
    if value is None:
        return "-"
    if not interval:
        return f"{value * 100:.0f}% {counted}"
    low, high = interval
    return f"{value * 100:.0f}% [{low * 100:.0f}, {high * 100:.0f}] {counted}"


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


def _status(args: argparse.Namespace) -> int:
    status = call(lambda client: client.status(args.name))
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
    if status.get("next_cycle"):
        _print_next_cycle(NextCyclePublic.model_validate(status["next_cycle"]))
    rollback = status.get("last_rollback")
    if rollback:
        print(f"  rollback     {rollback['status']} {rollback['decided_at']}: {rollback['reason']}")
    return 0


def _tools(args: argparse.Namespace) -> int:
    """The loop's endpoint and each tool: on the allow-list, listed by the server, and the
    server's readOnlyHint (its word, shown; only the allow-list decides what is asked)."""
    found = call(lambda client: client.loop_tools(args.name))
    if args.json:
        print_model(found)
        return 0
    if found.endpoint is None:
        print(f"loop {found.loop} names no tool endpoint (curation_policy.tool_endpoint)")
        return 0
    print(f"loop {found.loop}: tool endpoint {found.endpoint} ({found.kind or 'unknown'})")
    if found.error:
        print(f"  {found.error}")
    print(f"  {'TOOL':<28} {'ALLOWED':<8} {'LISTED':<7} {'READ-ONLY':<10} DESCRIPTION")
    for tool in found.tools:
        print(
            f"  {tool.name:<28} {_yes(tool.allowed):<8} {_yes(tool.listed):<7} "
            f"{_yes(tool.read_only_hint):<10} {' '.join((tool.description or '').split())[:50]}"
        )
    print("  READ-ONLY is the server's own hint, never permission: only allowed tools are asked")
    return 0


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")
