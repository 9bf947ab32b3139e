"""The process pool: chunks and prefetched batches give the serial result, and a prefetched
result is only taken for a trace row that is still exactly the one prefetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.curation.policy import CurationPolicy
from services.curation.workers import (
    Prepared,
    PrepareJob,
    PreparePool,
    prepare_traces,
    shared_pool,
)
from services.db.queries.traces import TraceRow
from services.environments.base import Rejection, TaskSpec
from tests.services.curation.support import QaAdapter, trace_body


class WhereAdapter(QaAdapter):
    """Records which process built the task, to tell prefetched results from fresh ones."""

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        task = super().task_from_trace(trace)
        if isinstance(task, Rejection):
            return task
        return replace(task, metadata={**task.metadata, "pid": os.getpid()})


def rows(n: int, *, start: int = 1, question: str = "where is order") -> list[TraceRow]:
    out = []
    for index in range(start, start + n):
        body = trace_body(f"t{index}", f"{question} {index}?", answer=str(index))
        text = json.dumps(body)
        out.append(TraceRow(index, f"t{index}", "m1", False, None, "wrong_answer", text, len(text)))
    return out


def job(traces: list[TraceRow], *, adapter: Any = None, **policy: Any) -> PrepareJob:
    return PrepareJob(7, "qa", CurationPolicy.from_json(policy), adapter or QaAdapter(), traces)


def comparable(results: list[Any], *, keep_spec: bool = True) -> list[Any]:
    """Results as plain values (a signature is a numpy array, which ``==`` cannot judge)."""
    return [
        (
            replace(r, signature=None, spec_json=r.spec_json if keep_spec else ""),
            r.signature.tobytes(),
        )
        if isinstance(r, Prepared)
        else r
        for r in results
    ]


def builder(result: Any) -> int:
    assert isinstance(result, Prepared)
    return int(json.loads(result.spec_json)["metadata"]["pid"])


@pytest.fixture(scope="module")
def pool() -> Iterator[PreparePool]:
    with PreparePool(2) as pool:
        pool.start()
        yield pool


def test_chunks_on_two_processes_equal_one_process(pool: PreparePool) -> None:
    batch = job(rows(700))
    assert comparable(pool.prepare(batch)) == comparable(prepare_traces(batch))


def test_a_prefetched_batch_is_taken_and_equals_a_fresh_one(pool: PreparePool) -> None:
    upcoming = job(rows(300), adapter=WhereAdapter())
    pool.prefetch(upcoming)
    results = pool.prepare(upcoming)
    assert {builder(r) for r in results} != {os.getpid()}  # built by the worker
    fresh = prepare_traces(upcoming)
    assert comparable(results, keep_spec=False) == comparable(fresh, keep_spec=False)


def test_rows_that_changed_or_were_not_prefetched_are_computed_again(pool: PreparePool) -> None:
    prefetched = rows(200)
    pool.prefetch(job(prefetched, adapter=WhereAdapter()))
    changed = rows(1, start=5, question="a different question")[0]
    now = [*prefetched[:4], changed, *prefetched[5:150], *rows(20, start=1000)]
    results = pool.prepare(job(now, adapter=WhereAdapter()))
    assert [r.trace_id for r in results] == [t.id for t in now]
    by_id = {r.trace_id: r for r in results}
    assert builder(by_id[5]) == os.getpid()
    assert "a different question" in json.loads(by_id[5].spec_json)["prompt"]
    assert builder(by_id[1000]) == os.getpid()
    assert builder(by_id[1]) != os.getpid()


def test_a_prefetch_under_another_policy_is_not_taken(pool: PreparePool) -> None:
    upcoming = rows(50)
    pool.prefetch(job(upcoming, adapter=WhereAdapter()))
    results = pool.prepare(job(upcoming, adapter=WhereAdapter(), success_sample_rate=0.5))
    assert {builder(r) for r in results} == {os.getpid()}


def test_one_process_starts_nothing() -> None:
    pool = PreparePool(1)
    assert pool.start() == []
    batch = job(rows(300))
    pool.prefetch(batch)
    assert comparable(pool.prepare(batch)) == comparable(prepare_traces(batch))
    pool.close()


def test_processes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PreparePool(0)


def test_closing_the_pool_stops_its_processes() -> None:
    pool = PreparePool(2)
    (pid,) = pool.start()
    assert pid != os.getpid()
    pool.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_one_shared_pool_per_size() -> None:
    assert shared_pool(3) is shared_pool(3)
    assert shared_pool(3) is not shared_pool(1)


def test_pool_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    """``kill -9`` of a worker process must not leave its pool's processes behind."""
    pids = tmp_path / "pids"
    script = (
        "import sys, time\n"
        "from services.curation.workers import PreparePool\n"
        "pool = PreparePool(2)\n"
        f"open({str(pids)!r}, 'w').write(' '.join(map(str, pool.start())))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        (child,) = [int(p) for p in pids.read_text().split()]
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.2)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
