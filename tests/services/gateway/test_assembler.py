"""Placing calls into sessions in one batch gives the sessions placing them one at a time
gives: conversations continued within the batch, session keys named twice, a retried turn
that no longer ends its session's conversation, and text completions (placed call by call)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from sqlalchemy import select

from services.db.models import GatewayCall, GatewaySession
from services.db.queries.loops import LoopFields
from services.db.session import SessionFactory
from services.gateway import assembler
from services.gateway.capture import CHAT, COMPLETION, CapturedCall
from services.gateway.writer import call_row
from services.ingest.provisioning import provision_loop
from services.secrets import SecretBox
from tests.services.api.support import SECRET_KEY

SYSTEM = {"role": "system", "content": "be brief"}
ASK_A = {"role": "user", "content": "price of a pear?"}
ASK_B = {"role": "user", "content": "price of a plum?"}
CALL_A = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "name": "get", "arguments": {"item": "pear"}}],
}
RESULT_A = {"role": "tool", "tool_call_id": "c1", "content": "12"}
ANSWER_A = {"role": "assistant", "content": "12"}
THANKS = {"role": "user", "content": "thanks"}


def chat(name: str, messages: list[Any], reply: dict[str, Any], key: str | None = None) -> Any:
    return (name, CHAT, messages, reply, key, None)


def text(name: str, prompt: str, completion: str) -> Any:
    return (name, COMPLETION, [{"role": "user", "content": prompt}], completion, None, prompt)


SCRIPT = [
    chat("a1", [SYSTEM, ASK_A], CALL_A),
    chat("b1", [SYSTEM, ASK_B], {"role": "assistant", "content": "9"}),
    chat("a2", [SYSTEM, ASK_A, CALL_A, RESULT_A], ANSWER_A),
    chat("k1", [ASK_B], {"role": "assistant", "content": "x"}, key="agent-run-7"),
    chat("k2", [ASK_A], {"role": "assistant", "content": "y"}, key="agent-run-7"),
    chat("a2-retry", [SYSTEM, ASK_A, CALL_A, RESULT_A], ANSWER_A),  # A ended past it
    text("t1", "Hello", " world"),
    text("t2", "Hello world, and", " more"),
    chat("a3", [SYSTEM, ASK_A, CALL_A, RESULT_A, ANSWER_A, THANKS], ANSWER_A),
]
EXPECTED = {
    frozenset({"a1", "a2", "a3"}),
    frozenset({"b1"}),
    frozenset({"k1", "k2"}),
    frozenset({"a2-retry"}),
    frozenset({"t1", "t2"}),
}


def _loop(session_factory: SessionFactory, name: str) -> int:
    with session_factory.begin() as session:
        created = provision_loop(
            session,
            fields=LoopFields(
                name=name, environment="toolcalc", serving_target={"kind": "local", "model": "m"}
            ),
            box=SecretBox.from_keys(SECRET_KEY),
        )
        return int(created.loop.id)


def _store_script(session_factory: SessionFactory, loop_id: int) -> None:
    start = dt.datetime(2026, 12, 6, tzinfo=dt.UTC).timestamp()
    with session_factory.begin() as session:
        for index, (name, kind, messages, reply, key, prompt) in enumerate(SCRIPT):
            captured = CapturedCall(
                loop_id=loop_id,
                loop="l",
                kind=kind,
                messages=messages,
                tools=[],
                reply=reply if isinstance(reply, dict) else {"role": "assistant", "content": reply},
                started_at=start + index,
                captured_at=start + index + 0.5,
                call_id=f"{loop_id}-{name}",
                session_key=key,
                prompt=prompt,
            )
            row = call_row(captured)
            session.add(
                GatewayCall(
                    loop_id=row[0],
                    call_id=row[1],
                    kind=row[2],
                    started_at=row[3],
                    captured_at=row[4],
                    session_key=row[5],
                    prefix_hashes=row[8],
                    after_hash=row[9],
                    body=json.loads(row[10]),
                )
            )


def _sessions(session_factory: SessionFactory, loop_id: int) -> set[tuple[Any, ...]]:
    with session_factory() as session:
        calls = session.scalars(select(GatewayCall).where(GatewayCall.loop_id == loop_id)).all()
        rows = {
            row.id: row
            for row in session.scalars(
                select(GatewaySession).where(GatewaySession.loop_id == loop_id)
            )
        }
        members: dict[int, set[str]] = {}
        for call in calls:
            assert call.session_id is not None, call.call_id
            members.setdefault(call.session_id, set()).add(call.call_id.split("-", 1)[1])
        return {
            (
                frozenset(names),
                rows[sid].explicit,
                rows[sid].call_count,
                rows[sid].last_after_hash,
                rows[sid].key.startswith("call-"),
            )
            for sid, names in members.items()
        }


def test_a_batch_is_placed_as_one_call_at_a_time_is(
    session_factory: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch, single = _loop(session_factory, "batch"), _loop(session_factory, "single")
    _store_script(session_factory, batch)
    _store_script(session_factory, single)

    with session_factory.begin() as session:
        assert assembler.place_calls(session, loop_id=batch) == len(SCRIPT)
    monkeypatch.setattr(assembler, "PLACE_LIMIT", 1)
    placed = 0
    while True:
        with session_factory.begin() as session:
            count = assembler.place_calls(session, loop_id=single)
        if not count:
            break
        placed += count
    assert placed == len(SCRIPT)

    in_batch = _sessions(session_factory, batch)
    assert in_batch == _sessions(session_factory, single)
    assert {group[0] for group in in_batch} == EXPECTED
    explicit = {group[0]: group[1] for group in in_batch}
    assert explicit[frozenset({"k1", "k2"})] is True
    assert explicit[frozenset({"a1", "a2", "a3"})] is False
