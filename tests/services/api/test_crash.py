"""Durable before acknowledged: kill -9 the api under load; every 2xx trace is in Postgres."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from services.db.session import SessionFactory
from tests.services.api.support import (
    api_process,
    body_of,
    existing_external_ids,
    free_port,
    make_trace,
    provision_toolcalc_loop,
    signed_headers,
)
from tests.support import assert_eventually

CLIENTS = 8
ACKS_BEFORE_KILL = 300


@pytest.mark.slow
def test_every_acknowledged_trace_survives_kill_9(
    database_url: str, session_factory: SessionFactory
) -> None:
    loop_id, secret = provision_toolcalc_loop(session_factory, "crash")
    port = free_port()
    acknowledged: list[str] = []
    unexpected: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(number: int) -> None:
        url = f"http://127.0.0.1:{port}/v1/loops/crash/traces"
        with httpx.Client(timeout=10) as http:
            sequence = 0
            while not stop.is_set():
                external_id = f"c{number}-{sequence}"
                sequence += 1
                body = body_of(make_trace(external_id))
                try:
                    response = http.post(url, content=body, headers=signed_headers(secret, body))
                except httpx.TransportError:
                    return  # the server is gone: this request was never acknowledged
                with lock:
                    if response.status_code == 200:
                        acknowledged.append(external_id)
                    elif response.status_code != 503:
                        unexpected.append(f"{response.status_code} {response.text[:200]}")

    with api_process(database_url, port) as process:
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()

        def enough_load() -> None:
            with lock:
                if unexpected:
                    raise RuntimeError(f"unexpected answer under load: {unexpected[0]}")
                assert len(acknowledged) >= ACKS_BEFORE_KILL

        assert_eventually(enough_load, timeout=120, interval=0.01)
        process.send_signal(signal.SIGKILL)  # mid-load: requests are in flight and queued
        process.wait(timeout=30)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

    with lock:
        acked = list(acknowledged)
    # After a restart the api serves again, and every acknowledged trace is there.
    with api_process(database_url, port):
        body = body_of(make_trace("after-restart"))
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/loops/crash/traces",
            content=body,
            headers=signed_headers(secret, body),
            timeout=30,
        )
        assert response.status_code == 200
    with session_factory() as session:
        stored = existing_external_ids(session=session, loop_id=loop_id, external_ids=acked)
    missing = sorted(set(acked) - stored)
    assert len(acked) >= ACKS_BEFORE_KILL
    assert missing == [], f"{len(missing)} acknowledged traces were lost: {missing[:10]}"
