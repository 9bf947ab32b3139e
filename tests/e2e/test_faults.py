"""Faults of the servers a loop stands on, end to end (issue 43, item 9).

Every part is a real process, as in test_chaos.py: the embedded Postgres and Temporal dev
server, ``ratchet api``, ``ratchet worker`` and the jobs the local executor starts, on the
tiny model. Three faults, one test each:

- ``kill -9`` of the api while an agent posts batches of traces back to back: every trace
  the api answered 2xx for is stored (a 2xx is sent only once the batch is durable), the
  batches cut by the kill are posted again after the restart (as a webhook sender retries)
  and stored once, and the worker curates them all;
- a Postgres restart while the cycle's train job runs;
- a Temporal dev-server restart (same file database) while the cycle's train job runs.

After each: no accepted trace lost or stored twice, one job per run id (the run adopted,
never launched again), the cycle closes with a gate decision, and the loop goes on: new
failures start cycle 2.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from services.client import LoopPolicies, RatchetClient
from services.db.models import Cycle, Loop, Run, Trace
from services.ingest.signature import sign
from tests.e2e.support import (
    LiveStack,
    cycle_closed,
    loop_cycle,
    make_tiny_champion,
    new_tasks_trigger,
    toolcalc_traces,
    wait_for,
)
from workflows.ids import run_id_for

pytestmark = pytest.mark.slow

LOOP = "faults"
MIN_NEW_TASKS = 8
TRAIN_RUN = run_id_for(LOOP, 1, "train")
TRAINING_PROFILE: dict[str, Any] = {
    "algorithm": "grpo",
    "device": "cpu",
    "hyperparameters": {
        "steps": 40,  # long enough to restart a server under it
        "tasks_per_step": 4,
        "group_size": 4,
        "max_turns": 3,
        "max_new_tokens": 16,
        "sft_coef": 0.5,
        "threads": 1,
    },
}
GATE_POLICY: dict[str, Any] = {"mode": "auto", "eval_samples": 2}
CURATION_POLICY: dict[str, Any] = {
    "eval_fraction": 0.3,
    "heldout_fraction": 0.0,
    "success_sample_rate": 1.0,
}


def create_loop(
    live: LiveStack, client: RatchetClient, tmp_path: Path, *, min_new_tasks: int = MIN_NEW_TASKS
) -> Sender:
    """The loop (a tiny champion, no serving target), started; a sender for its webhook."""
    policies = LoopPolicies(
        training_profile=TRAINING_PROFILE,
        serving_target={"kind": "none"},
        gate_policy=GATE_POLICY,
        trigger_policy=new_tasks_trigger(min_new_tasks),
        curation_policy=CURATION_POLICY,
    )
    created = client.create_loop(LOOP, "toolcalc", policies=policies)
    client.set_champion(LOOP, str(make_tiny_champion(tmp_path / "champion")))
    client.start_loop(LOOP)
    return Sender(f"{live.api_url}/v1/loops/{LOOP}/traces", created.signing_secret)


# Posting as a webhook sender does: a batch that was not answered 2xx is sent again ------------


@dataclass
class Sender:
    """Posts batches of traces to the loop's webhook, each until it is answered 2xx."""

    url: str
    secret: str
    accepted: set[str] = field(default_factory=set)  # external ids of 2xx answers
    cut: int = 0  # requests that got no answer (the api died under them)
    refused: Counter[int] = field(default_factory=Counter)  # non-2xx statuses
    in_flight: threading.Event = field(default_factory=threading.Event)

    def send(self, batch: list[dict[str, Any]], *, deadline_s: float = 300) -> None:
        body = httpx.Request("POST", self.url, json={"traces": batch}).content
        deadline = time.monotonic() + deadline_s
        while True:
            msg_id = f"msg_{uuid.uuid4().hex}"
            stamp = int(time.time())
            headers = {
                "content-type": "application/json",
                "webhook-id": msg_id,
                "webhook-timestamp": str(stamp),
                "webhook-signature": sign(self.secret, msg_id, stamp, body),
            }
            response = self._post(body, headers)
            if response is not None and response.is_success:
                self.accepted.update(trace["external_id"] for trace in batch)
                return
            if response is not None:
                self.refused[response.status_code] += 1
            assert time.monotonic() < deadline, f"batch never accepted: {self}"
            time.sleep(0.5)

    def _post(self, body: bytes, headers: dict[str, str]) -> httpx.Response | None:
        """The api's answer, or None when it gave none (counted in ``cut``)."""
        self.in_flight.set()
        try:
            return httpx.post(self.url, content=body, headers=headers, timeout=60)
        except httpx.HTTPError:
            self.cut += 1
            return None
        finally:
            self.in_flight.clear()


def post_in_background(sender: Sender, batches: list[list[dict[str, Any]]]) -> threading.Thread:
    thread = threading.Thread(target=lambda: [sender.send(b) for b in batches], daemon=True)
    thread.start()
    return thread


# Checks ------------------------------------------------------------------------------------------


def stored_ids(live: LiveStack) -> Counter[str]:
    with live.sessions()() as session:
        rows = session.scalars(select(Trace.external_id).join(Loop).where(Loop.name == LOOP))
        return Counter(rows)


def uncurated(live: LiveStack) -> int:
    with live.sessions()() as session:
        count = session.scalar(
            select(func.count())
            .select_from(Trace)
            .join(Loop)
            .where(Loop.name == LOOP, Trace.curated_at.is_(None))
        )
    return int(count or 0)


def assert_every_trace_stored_once_and_curated(live: LiveStack, posted: set[str]) -> None:
    stored = stored_ids(live)
    assert set(stored) == posted, sorted(set(posted) ^ set(stored))[:5]
    assert max(stored.values()) == 1

    def all_curated() -> None:
        assert uncurated(live) == 0, f"{uncurated(live)} traces uncurated"

    wait_for(all_curated, timeout=180, what="every trace curated")


def train_job_running(live: LiveStack) -> Callable[[], None]:
    def check() -> None:
        cycle = loop_cycle(live, LOOP)
        assert cycle.ended_at is None, f"cycle 1 ended early: {cycle.outcome_detail}"
        with live.sessions()() as session:
            run = session.get(Run, TRAIN_RUN)
        assert run is not None and run.status == "running", run and run.status

    return check


def assert_one_job_per_run_and_a_decision(live: LiveStack, cycle: Cycle) -> None:
    assert cycle.outcome in ("promoted", "rejected"), (cycle.outcome, cycle.outcome_detail)
    with live.sessions()() as session:
        runs = session.scalars(select(Run).where(Run.cycle_id == cycle.id)).all()
    assert TRAIN_RUN in {run.id for run in runs}
    for run in runs:
        assert run.status == "succeeded", (run.id, run.status, run.error)
        launches = live.job_launches(LOOP, run.id)
        assert launches.started_lines == 1, (run.id, launches.started_lines)
        assert launches.handle_pid is not None and launches.handle_pid == launches.supervisor_pid
        assert launches.exit is not None and launches.exit["returncode"] == 0, launches.exit


def assert_the_loop_goes_on(live: LiveStack, sender: Sender) -> None:
    """New failures after the cycle start the next one."""
    for batch in batches_of(toolcalc_traces(24, seed=31, passing=False, id_prefix="after"), 12):
        sender.send(batch)

    def second_cycle() -> None:
        loop_cycle(live, LOOP, number=2)

    wait_for(second_cycle, timeout=240, what="cycle 2 to start")


def batches_of(traces: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [traces[i : i + size] for i in range(0, len(traces), size)]


def flood(count: int) -> list[dict[str, Any]]:
    """``count`` failing traces of 100 toolcalc tasks (an agent's busy hour: each task
    failed many times), each with an id of its own."""
    base = toolcalc_traces(100, seed=21, passing=False, id_prefix="flood")
    return [{**base[i % len(base)], "external_id": f"flood-{i}"} for i in range(count)]


def first_traces() -> list[dict[str, Any]]:
    traces = toolcalc_traces(40, seed=11, passing=False, id_prefix="fail")
    return traces + toolcalc_traces(6, seed=12, passing=True, id_prefix="ok")


# The faults ----------------------------------------------------------------------------------


def test_kill9_of_the_api_during_a_batch_ingest_loses_no_accepted_trace(
    live: LiveStack, tmp_path: Path
) -> None:
    with live.diagnostics(), live.client() as client:
        # No cycle here: the loop only curates what arrives (its trigger checks do).
        sender = create_loop(live, client, tmp_path, min_new_tasks=100_000)
        traces = flood(4000)
        posting = post_in_background(sender, batches_of(traces, 100))
        wait_for(lambda: _at_least(len(sender.accepted), 200), timeout=120, what="batches accepted")
        assert sender.in_flight.wait(30)
        accepted_before = set(sender.accepted)
        live.kill_api()  # batches go back to back: one was in flight a moment ago
        assert stored_ids(live).keys() >= accepted_before  # every 2xx was durable
        live.start_api()
        posting.join(timeout=600)
        assert not posting.is_alive()
        assert sender.cut >= 1, "the kill cut no request"
        posted = {trace["external_id"] for trace in traces}
        assert sender.accepted == posted
        assert_every_trace_stored_once_and_curated(live, posted)


def test_a_postgres_restart_during_a_cycle(live: LiveStack, tmp_path: Path) -> None:
    with live.diagnostics(), live.client() as client:
        sender = create_loop(live, client, tmp_path)
        first = first_traces()
        sender.send(first)
        wait_for(train_job_running(live), timeout=240, what="cycle 1's train job to run")
        during = toolcalc_traces(6, seed=13, passing=False, id_prefix="during")
        posting = post_in_background(sender, [during])  # answered 503 while Postgres is down
        live.restart_postgres(down_s=5)
        posting.join(timeout=300)
        cycle = wait_for(cycle_closed(live, LOOP), timeout=600, what="cycle 1 to close")
        assert_one_job_per_run_and_a_decision(live, cycle)
        assert_every_trace_stored_once_and_curated(live, {t["external_id"] for t in first + during})
        assert_the_loop_goes_on(live, sender)


def test_a_temporal_restart_during_a_cycle(live: LiveStack, tmp_path: Path) -> None:
    with live.diagnostics(), live.client() as client:
        sender = create_loop(live, client, tmp_path)
        first = first_traces()
        sender.send(first)
        wait_for(train_job_running(live), timeout=240, what="cycle 1's train job to run")
        live.restart_temporal(down_s=5)
        during = toolcalc_traces(6, seed=13, passing=False, id_prefix="during")
        sender.send(during)  # ingest needs Postgres only
        cycle = wait_for(cycle_closed(live, LOOP), timeout=600, what="cycle 1 to close")
        assert_one_job_per_run_and_a_decision(live, cycle)
        assert_every_trace_stored_once_and_curated(live, {t["external_id"] for t in first + during})
        assert_the_loop_goes_on(live, sender)


def _at_least(value: int, minimum: int) -> None:
    assert value >= minimum, f"{value} < {minimum}"
