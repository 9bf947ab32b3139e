"""The spool's drain into Postgres: text Postgres cannot hold (a NUL, a lone surrogate), which
a model may sample and an agent may send, is stored replaced, never refused: a refused row
was a call the agent had been answered for and Postgres never got (the outage test's loss)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from sqlalchemy import Engine, select

from services.chat.text import REPLACEMENT
from services.db.models import GatewayCall
from services.db.queries.loops import LoopFields
from services.db.session import SessionFactory
from services.gateway.capture import CapturedCall
from services.gateway.conversation import conversation_digests
from services.gateway.spool import Spool
from services.gateway.writer import SpoolWriter
from services.ingest.provisioning import provision_loop
from services.ingest.service import conninfo_from_engine
from services.secrets import SecretBox
from tests.services.api.support import SECRET_KEY

UNSTORABLE = "a\x00b\ud800c"  # NUL, and a lone surrogate a JSON escape can make


def _loop_id(session_factory: SessionFactory) -> int:
    with session_factory.begin() as session:
        created = provision_loop(
            session,
            fields=LoopFields(
                name="writer",
                environment="toolcalc",
                serving_target={"kind": "local", "model": "m"},
            ),
            box=SecretBox.from_keys(SECRET_KEY),
        )
        return int(created.loop.id)


def _drained(engine: Engine, tmp_path: Path, calls: list[CapturedCall]) -> SpoolWriter:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20, fsync_s=0.01)
    spool.open()
    try:
        for call in calls:
            assert spool.append(call.encode())
        writer = SpoolWriter(spool, conninfo_from_engine(engine))

        async def drain() -> None:
            try:
                await writer.drain(spool.read(100))
            finally:
                await writer.stop(timeout_s=1)

        asyncio.run(drain())
        assert spool.read(100) == []  # the cursor moved past every record
        return writer
    finally:
        spool.close()


def test_text_postgres_cannot_hold_is_stored_replaced_and_no_call_is_refused(
    engine: Engine, session_factory: SessionFactory, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": UNSTORABLE}]
    reply = {"role": "assistant", "content": "\x00\udcf9 ok"}
    call = CapturedCall(
        loop_id=_loop_id(session_factory),
        loop="writer",
        kind="chat",
        messages=messages,
        tools=[],
        reply=reply,
        started_at=time.time(),
        session_key="session\x00",
        response_id="chatcmpl-\x00",
        model_version="v\ud800",
    )
    clean = CapturedCall(**{**vars(call), "call_id": "clean", "messages": [], "reply": {}})
    writer = _drained(engine, tmp_path, [call, clean])

    assert writer.stored == 2
    with session_factory() as session:
        rows = {row.call_id: row for row in session.scalars(select(GatewayCall))}
    stored = rows[call.call_id]
    assert stored.body["messages"][0]["content"] == f"a{REPLACEMENT}b{REPLACEMENT}c"
    assert stored.body["reply"]["content"] == f"{REPLACEMENT}{REPLACEMENT} ok"
    assert (stored.session_key, stored.response_id, stored.model_version) == (
        f"session{REPLACEMENT}",
        f"chatcmpl-{REPLACEMENT}",
        f"v{REPLACEMENT}",
    )
    # The digests are of the text as it was sent: the agent's next call, which repeats this
    # conversation as it has it, still finds its session.
    assert stored.after_hash == conversation_digests(messages, reply)[1]
    assert "clean" in rows


def test_a_record_is_the_same_call_after_the_spool_whatever_its_text() -> None:
    call = CapturedCall(
        loop_id=1,
        loop="l",
        kind="chat",
        messages=[{"role": "user", "content": UNSTORABLE + " ü"}],
        tools=[],
        reply={"role": "assistant", "content": "ü"},
        started_at=1.0,
    )
    data = call.encode()
    assert json.loads(data)["messages"][0]["content"] == UNSTORABLE + " ü"
    assert CapturedCall.decode(data) == call
    plain = CapturedCall(**{**vars(call), "messages": [{"role": "user", "content": "ü"}]})
    assert "ü".encode() in plain.encode()  # non-ASCII as itself where it can be
