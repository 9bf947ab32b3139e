"""toolcalc tasks: requests, the price table, how a request is solved, and task generation.

A request is a one-operator expression over integers and prices: ``12+345``, ``17*23``,
``$pear*37``, ``$fig+250``, ``$kiwi+$plum``. ``$item`` is the price of the item in the
built-in table (in USD), which the agent can only learn by calling the price tool. Solving a
request takes one tool call per ``$item`` (left to right) and one for the operator, then an
answer: the sequence of calls is the task's *program*, recomputed from the request alone.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from services.environments.toolcalc.api import Op, ToolAPI

PRICES_USD: dict[str, int] = {
    "apple": 4,
    "pear": 12,
    "fig": 7,
    "kiwi": 9,
    "lime": 2,
    "plum": 15,
    "date": 21,
    "melon": 34,
    "grape": 18,
    "mango": 27,
    "peach": 13,
    "lemon": 6,
}
PRICES_EUR: dict[str, int] = {item: (usd * 9 + 5) // 10 for item, usd in PRICES_USD.items()}
PRICES: dict[str, dict[str, int]] = {"usd": PRICES_USD, "eur": PRICES_EUR}

_TERM = r"(\d{1,4}|\$[a-z]{1,16})"
_REQUEST = re.compile(rf"^\s*{_TERM}\s*(?:([+*])\s*{_TERM})?\s*$")

# Generated request families. Two-price requests (``$kiwi+$plum``) are valid and verified
# (traces may carry them) but not generated: 132 of them exist, too few to hold out.
FAMILIES = ("a+b", "a*b", "$x*b", "$x+b")


class UnverifiableRequest(ValueError):
    """A request toolcalc cannot check: ``reason`` is a stable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Program:
    """The calls that solve a request, in order, and the answer they lead to."""

    calls: tuple[tuple[Op, tuple[Any, ...]], ...]
    answer: int


def normalize_request(request: str) -> str:
    return re.sub(r"\s+", "", request)


def solve(request: str, api: ToolAPI) -> Program:
    """The program for ``request`` under ``api``; raises :class:`UnverifiableRequest`."""
    match = _REQUEST.match(request)
    if match is None:
        raise UnverifiableRequest(
            "unverifiable_request", f"request {request[:60]!r} is not a toolcalc expression"
        )
    left, op_char, right = match.group(1), match.group(2), match.group(3)
    if op_char is None and not left.startswith("$"):
        raise UnverifiableRequest("no_tool_needed", f"request {request!r} needs no tool")
    lookup_args: tuple[Any, ...] = ("usd",) if "cur" in api.by_op("lookup").params else ()
    calls: list[tuple[Op, tuple[Any, ...]]] = []
    values: list[int] = []
    for term in (left, right):
        if term is None:
            continue
        if term.startswith("$"):
            item = term[1:]
            if item not in PRICES_USD:
                raise UnverifiableRequest(
                    "unknown_item", f"item {item!r} is not in the price table"
                )
            calls.append(("lookup", (item, *lookup_args)))
            values.append(PRICES_USD[item])
        else:
            values.append(int(term))
    if op_char is None:
        return Program(tuple(calls), values[0])
    op: Op = "add" if op_char == "+" else "mul"
    answer = values[0] + values[1] if op == "add" else values[0] * values[1]
    calls.append((op, (values[0], values[1])))
    return Program(tuple(calls), answer)


def sample_request(rng: random.Random) -> str:
    """One request from an even mix of the generated families."""
    family = rng.choice(FAMILIES)
    items = sorted(PRICES_USD)
    if family == "a+b":
        return f"{rng.randint(10, 999)}+{rng.randint(10, 999)}"
    if family == "a*b":
        return f"{rng.randint(2, 99)}*{rng.randint(2, 99)}"
    if family == "$x*b":
        return f"${rng.choice(items)}*{rng.randint(2, 99)}"
    return f"${rng.choice(items)}+{rng.randint(10, 999)}"
