"""A replay loop's traffic for bootstrap's tests: failures and successes of a library-loans
desk, one conversation (and so one cluster) per ticket number."""

from __future__ import annotations

from typing import Any

from services.db.session import SessionFactory
from tests.services.curation.support import add_traces, curate_all, make_loop
from tests.services.environments.replay_traces import call, failing_trace, result

ANSWER = "The hold is blocked: patron P-204 has 3 overdue loans."
# Splits decided by each cluster's hash: a third each way, so a dozen tickets fill all three.
POLICY = {"success_sample_rate": 0.0, "eval_fraction": 0.3, "heldout_fraction": 0.3}


_BOOKS = ("Dune", "Kindred", "Beloved", "Solaris", "Emma", "Ulysses", "Middlemarch", "Ubik")
_ASKS = (
    "wants a hold on",
    "asks whether we can reserve",
    "would like to borrow",
    "needs the next free copy of",
    "is waiting to check out",
    "requests a reservation for",
)


def question(n: int) -> str:
    """Ticket ``n``'s request: worded apart enough that every ticket is its own cluster."""
    book = f"{_BOOKS[n % len(_BOOKS)]} volume {n * 37 % 101}"
    return (
        f"Patron P-{300 + n * 17} {_ASKS[n % len(_ASKS)]} '{book}' at branch {n * 7} "
        f"(ticket {n}, desk {chr(65 + n % 26)})."
    )


def failure(n: int) -> dict[str, Any]:
    """Ticket ``n`` as the agent got it wrong (claimed the hold despite the tool's error)."""
    trace = failing_trace(f"fail-{n}")
    trace["messages"][1] = {"role": "user", "content": question(n)}
    return trace


def success(n: int, *, external_id: str | None = None) -> dict[str, Any]:
    """Ticket ``n`` solved: the agent searched, checked the loans, and answered right."""
    trace = failing_trace(external_id or f"ok-{n}", reference_answer=None, metadata={})
    trace["messages"][1] = {"role": "user", "content": question(n)}
    trace["messages"][4:] = [
        call("c2", "patron_loans", {"patron_id": "P-204"}),
        result("c2", "patron_loans", '{"open": 5, "overdue": 3}'),
        {"role": "assistant", "content": ANSWER},
    ]
    trace["outcome"] = {"success": True, "score": 1.0}
    return trace


def replay_loop(session_factory: SessionFactory, name: str = "desk", **policy: Any) -> int:
    return make_loop(
        session_factory, name, environment="replay", curation_policy={**POLICY, **policy}
    )


def curate(session_factory: SessionFactory, loop_id: int) -> None:
    from services.environments import get_environment

    curate_all(session_factory, loop_id, adapter=get_environment("replay"))


def post(session_factory: SessionFactory, loop_id: int, bodies: list[dict[str, Any]]) -> list[int]:
    return add_traces(session_factory, loop_id, bodies)
