"""`ratchet api` with several worker processes: one port, every trace stored, metrics summed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.db.queries.loops import trace_stats
from services.db.session import SessionFactory
from tests.services.api.support import (
    api_process,
    body_of,
    free_port,
    make_trace,
    provision_toolcalc_loop,
    signed_headers,
)

WORKERS = 2


def sample(metrics_text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_several_workers_store_every_trace_and_sum_their_metrics(
    database_url: str, session_factory: SessionFactory
) -> None:
    loop_id, secret = provision_toolcalc_loop(session_factory, "multi")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/loops/multi/traces"
    with api_process(database_url, port, workers=WORKERS) as process:
        assert len(children(process.pid)) >= WORKERS
        # A new connection per request, so the kernel hands them to both workers.
        for n in range(40):
            body = body_of(make_trace(f"w-{n}"))
            response = httpx.post(url, content=body, headers=signed_headers(secret, body))
            assert response.status_code == 200, response.text
            assert response.json()["accepted"] == 1
        for n in range(10):  # duplicates, whichever worker stored the first one
            body = body_of(make_trace(f"w-{n}"))
            response = httpx.post(url, content=body, headers=signed_headers(secret, body))
            assert response.json()["duplicates"] == 1, response.text
        labels = {"loop": "multi", "source": "webhook"}
        route = {"route": "/v1/loops/{loop}/traces", "method": "POST", "status": "200"}
        for _ in range(6):  # whichever worker answers /metrics, it reports all of them
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert sample(text, "ratchet_ingest_traces_accepted_total", **labels) == 40
            assert sample(text, "ratchet_ingest_traces_duplicate_total", **labels) == 10
            assert sample(text, "ratchet_http_requests_total", **route) == 50
            assert sample(text, "ratchet_ingest_queue_depth") == 0
    assert process.returncode == 0
    with session_factory() as session:
        assert trace_stats(session=session, loop_id=loop_id).count == 40
