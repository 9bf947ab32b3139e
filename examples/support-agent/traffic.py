"""Pageturner's production traffic: a month of a hosted model answering tickets, as traces.

    python examples/support-agent/traffic.py --out DIR [--seed 0] [--count 1000]
                                             [--change-at 0.5]

writes ``DIR/traces.jsonl`` (``ratchet.trace/v1``, oldest first), ``DIR/feedback.jsonl``
(verdicts that arrive after the fact: ``{"external_id", "score", "label", "correction"?}``,
the body of the feedback API plus the trace it names) and ``DIR/manifest.json`` (the seed,
the change, the MCP server command that computes the same tool results, the counts).

Every episode is played against the shop's real tools (``bookshop.Shop``), so every tool
result in a trace is what the tool answers. The agent succeeds or fails as production
agents do (``SCENARIOS``):

- ``ok``: the needed calls, the shop's own wording; ``paraphrase``: the same facts worded
  otherwise (a success whose text differs from the reference);
- ``missing_call``: a needed call skipped, the answer made up (a refund never made, a date
  never looked up);
- ``wrong_id`` / ``wrong_format``: wrong arguments (two digits swapped, ``48213`` for
  ``PT-48213``, a misspelt title), the tool's error, an apology;
- ``wrong_fact``: the right calls, one fact of the answer wrong (a date, an amount, a count);
- after the **tool change** (``--change-at``, a share of the month: ``track_parcel`` of API
  v2 requires ``carrier``), tickets that track a parcel mostly fail: ``old_shape`` calls it
  as before, gets the usage error and answers from memory or apologises; ``recovered`` reads
  the error and calls again with the carrier; ``ok`` calls the new shape at once.

Three traces in four carry the shop's ``reference_answer``; the others are judged later by
feedback (a failure's with the correction). Deterministic from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bookshop import SYSTEM_PROMPT, TOOLS, Shop, eur
from tickets import REFERENCES, Ticket, TicketMaker

MODEL_VERSION = "hosted-large-2026-10"
MONTH_START = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
MONTH = timedelta(days=28)
REFERENCE_SHARE = 0.75  # traces that carry the shop's reference answer
RATED_SHARE = 0.2  # of those, the ones a customer also rates
SUCCESSES = frozenset({"ok", "paraphrase", "recovered"})
# How the hosted model fares (weights), before the change and, after it, on tickets that
# do not track a parcel, and after it on tickets that do.
SCENARIOS: dict[str, dict[str, int]] = {
    "steady": {
        "ok": 48,
        "paraphrase": 22,
        "missing_call": 9,
        "wrong_id": 5,
        "wrong_format": 5,
        "wrong_fact": 11,
    },
    "changed": {
        "ok": 9,
        "recovered": 14,
        "paraphrase": 4,
        "old_shape": 55,
        "missing_call": 7,
        "wrong_id": 4,
        "wrong_format": 3,
        "wrong_fact": 4,
    },
}
_ERROR_KIND = {
    "missing_call": "wrong_answer",
    "wrong_fact": "wrong_answer",
    "wrong_id": "tool_error",
    "wrong_format": "tool_error",
    "old_shape": "tool_error",
}


@dataclass
class Episode:
    """One conversation of the agent with the shop's tools (API ``api``), as it happened."""

    shop: Shop
    api: str
    ticket: Ticket
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.ticket.question},
        ]

    def call(self, name: str, **arguments: str) -> dict[str, Any]:
        """Call a tool; its result as an object (a usage error as ``{"error": text}``)."""
        call_id = f"call_{sum(1 for m in self.messages if m['role'] == 'tool') + 1}"
        self.messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "name": name, "arguments": dict(arguments)}],
            }
        )
        result = self.shop.call(self.api, name, arguments)
        self.messages.append(
            {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}
        )
        try:
            parsed = json.loads(result)
        except ValueError:
            return {"error": result}
        return parsed if isinstance(parsed, dict) else {"result": parsed}

    def answer(self, text: str) -> str:
        self.messages.append({"role": "assistant", "content": text})
        return text


@dataclass(frozen=True)
class Traffic:
    """The generated traffic: traces oldest first, feedback, and the change's time."""

    traces: list[dict[str, Any]]
    feedback: list[dict[str, Any]]
    change_at: datetime
    seed: int

    def manifest(self) -> dict[str, Any]:
        scenarios = Counter(
            f"{t['metadata']['tool_api']}/{t['metadata']['scenario']}" for t in self.traces
        )
        return {
            "schema": "pageturner.traffic/v1",
            "seed": self.seed,
            "traces": len(self.traces),
            "feedback": len(self.feedback),
            "successes": sum(bool(t["outcome"]["success"]) for t in self.traces),
            "change_at": self.change_at.isoformat(),
            "change": "track_parcel (API v2) requires carrier",
            "tools_command": f"python examples/support-agent/mcp_server.py --seed {self.seed}",
            "scenarios": dict(sorted(scenarios.items())),
        }


def generate(seed: int = 0, count: int = 1000, change_at: float = 0.5) -> Traffic:
    """``count`` traces over a month, the tool change at ``change_at`` of it."""
    if count < 1:
        raise ValueError("count must be at least 1")
    if not 0.0 <= change_at <= 1.0:
        raise ValueError("change_at must be a share of the month, between 0 and 1")
    shop = Shop(seed)
    rng = random.Random(f"pageturner/traffic/{seed}")
    maker = TicketMaker(shop, rng)
    change_time = MONTH_START + MONTH * change_at
    traces: list[dict[str, Any]] = []
    feedback: list[dict[str, Any]] = []
    for index in range(count):
        started = MONTH_START + MONTH * (index / count) + timedelta(seconds=rng.randint(0, 90))
        ticket = maker.next(started.date())
        api = "v2" if started >= change_time else "v1"
        era = "changed" if api == "v2" and "track_parcel" in ticket.needed_tools else "steady"
        weights = SCENARIOS[era]
        scenario = rng.choices(list(weights), weights=list(weights.values()))[0]
        episode = Episode(shop, api, ticket)
        play(episode, scenario, rng)
        external_id = f"pt-{seed}-{index:05d}"
        trace, verdict = _trace(episode, scenario, external_id, started, rng)
        traces.append(trace)
        if verdict is not None:
            feedback.append(verdict)
    return Traffic(traces, feedback, change_time, seed)


def play(episode: Episode, scenario: str, rng: random.Random) -> str:
    """Play ``scenario`` of the episode's ticket; the agent's final answer."""
    ticket = episode.ticket
    if ticket.kind == "stock":
        return _play_stock(episode, scenario, rng)
    order_id = ticket.order_id
    assert order_id is not None
    if scenario in ("wrong_id", "wrong_format"):
        bad = _swapped(order_id, episode.shop) if scenario == "wrong_id" else order_id[3:]
        episode.call("find_order", order_id=bad)
        return episode.answer(
            rng.choice(
                (
                    f"Sorry, I could not find an order {bad}. Could you check the number?",
                    "I'm afraid that order does not exist in our system.",
                )
            )
        )
    if scenario == "missing_call" and ticket.kind == "total":
        return episode.answer(REFERENCES["total"].format(**_wrong_facts(ticket, rng)))
    order = episode.call("find_order", order_id=order_id)
    if ticket.kind == "total":
        return _final(episode, scenario, rng)
    if ticket.kind == "refund_damaged":
        if scenario == "missing_call":
            return episode.answer(f"Sorry about the damage; our team will refund {order_id} soon.")
        episode.call("refund_order", order_id=order_id, reason="damaged")
        return _final(episode, scenario, rng)
    if scenario == "missing_call" and ticket.kind == "status":
        return episode.answer(
            f"Order {order_id} was shipped with {order['carrier']} and should arrive in a few days."
        )
    if not _track(episode, scenario, order):
        return episode.answer(
            rng.choice(
                (
                    f"Order {order_id} is on its way and should arrive in a few days.",
                    "Sorry, I can't check the parcel right now; please try again later.",
                    f"Order {order_id} is probably just delayed; please wait a few more days.",
                )
            )
        )
    if ticket.kind == "refund_lost":
        if scenario == "missing_call":
            return episode.answer(f"Order {order_id} seems delayed; please allow a few more days.")
        episode.call("refund_order", order_id=order_id, reason="lost")
    return _final(episode, scenario, rng)


def _track(episode: Episode, scenario: str, order: Mapping[str, Any]) -> bool:
    """Track the order's parcel as the scenario does; whether the status came back."""
    tracking_id, carrier = str(order["tracking_id"]), str(order["carrier"])
    if episode.api == "v1":
        episode.call("track_parcel", tracking_id=tracking_id)
        return True
    if scenario in ("old_shape", "recovered"):
        episode.call("track_parcel", tracking_id=tracking_id)  # the usage error
        if scenario == "old_shape":
            return False
    episode.call("track_parcel", tracking_id=tracking_id, carrier=carrier)
    return True


def _play_stock(episode: Episode, scenario: str, rng: random.Random) -> str:
    ticket = episode.ticket
    title = ticket.title
    assert title is not None
    if scenario == "missing_call":
        return episode.answer(f"Yes, '{title}' is in stock.")
    if scenario in ("wrong_id", "wrong_format"):
        book = episode.shop.book(title)
        author = book.author if book else ""
        asked = _misspelt(title, rng) if scenario == "wrong_id" else f"{title} by {author}"
        episode.call("check_stock", title=asked)
        return episode.answer(f"Sorry, we don't seem to carry '{title}'.")
    episode.call("check_stock", title=title)
    return _final(episode, scenario, rng)


def _final(episode: Episode, scenario: str, rng: random.Random) -> str:
    """The answer after the right calls: the reference, a paraphrase, or a wrong fact."""
    ticket = episode.ticket
    if scenario == "paraphrase":
        return episode.answer(ticket.paraphrase(rng))
    if scenario == "wrong_fact":
        return episode.answer(REFERENCES[ticket.case].format(**_wrong_facts(ticket, rng)))
    return episode.answer(ticket.reference)


def _wrong_facts(ticket: Ticket, rng: random.Random) -> dict[str, str]:
    """The ticket's facts with one that its answer states made wrong."""
    template = REFERENCES[ticket.case]
    stated = [k for k in ("date", "amount", "copies", "price", "refund") if f"{{{k}}}" in template]
    key = rng.choice(stated)
    facts = dict(ticket.facts)
    value = facts[key]
    if key == "date":
        day = datetime.fromisoformat(value) + timedelta(days=rng.choice((-3, -2, -1, 1, 2, 3)))
        facts[key] = day.date().isoformat()
    elif key in ("amount", "price"):
        facts[key] = eur(float(value.split()[0]) + rng.choice((-4.0, -2.5, 1.5, 3.5, 5.0)))
    elif key == "copies":
        facts[key] = str(int(value) + rng.choice((1, 2, 4)))
    else:
        facts[key] = f"RF-{10000 + (int(value[3:]) - 10000 + rng.randint(1, 999)) % 90000}"
    return facts


def _swapped(order_id: str, shop: Shop) -> str:
    """The order id with two adjacent digits swapped, not another order's id."""
    digits = order_id[3:]
    for i in range(len(digits) - 1):
        swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :]
        candidate = f"PT-{swapped}"
        if swapped != digits and candidate not in shop.orders:
            return candidate
    return f"PT-{digits[::-1]}"


def _misspelt(title: str, rng: random.Random) -> str:
    letters = [i for i, c in enumerate(title) if c.isalpha()]
    drop = rng.choice(letters[1:] or letters)
    return title[:drop] + title[drop + 1 :]


def _trace(
    episode: Episode, scenario: str, external_id: str, started: datetime, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The episode as ``ratchet.trace/v1``, and the feedback that comes later, if any."""
    ticket = episode.ticket
    success = scenario in SUCCESSES
    outcome: dict[str, Any] = {"success": success}
    if not success:
        outcome["error"] = {"kind": _ERROR_KIND[scenario], "message": "the customer reopened it"}
    trace: dict[str, Any] = {
        "schema": "ratchet.trace/v1",
        "external_id": external_id,
        "model_version": MODEL_VERSION,
        "started_at": started.isoformat(),
        "ended_at": (started + timedelta(seconds=rng.randint(2, 9))).isoformat(),
        "tools": TOOLS[episode.api],
        "messages": episode.messages,
        "outcome": outcome,
        "metadata": {
            "shop": "pageturner",
            "ticket": ticket.kind,
            "customer": ticket.customer,
            "tool_api": episode.api,
            "scenario": scenario,
            "needed_tools": list(ticket.needed_tools),
        },
    }
    with_reference = rng.random() < REFERENCE_SHARE
    if with_reference:
        trace["reference_answer"] = ticket.reference
    if with_reference and rng.random() >= RATED_SHARE:
        return trace, None
    verdict: dict[str, Any] = {"external_id": external_id}
    if success:
        verdict.update(score=1.0, label="resolved")
    else:
        verdict.update(score=0.0, label="unresolved", correction=ticket.reference)
    return trace, verdict


def write(traffic: Traffic, out: Path) -> None:
    """``traces.jsonl``, ``feedback.jsonl`` and ``manifest.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("traces.jsonl", traffic.traces), ("feedback.jsonl", traffic.feedback)):
        with (out / name).open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "manifest.json").write_text(json.dumps(traffic.manifest(), indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=1000, help="traces (at least 1)")
    parser.add_argument(
        "--change-at", type=float, default=0.5, help="when the tools change (share of the month)"
    )
    args = parser.parse_args(argv)
    try:
        traffic = generate(args.seed, args.count, args.change_at)
    except ValueError as exc:
        parser.error(str(exc))
    write(traffic, args.out)
    manifest = traffic.manifest()
    print(
        f"{manifest['traces']} traces ({manifest['successes']} successes), "
        f"{manifest['feedback']} feedback, tools change at {manifest['change_at']} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
