"""Curation gives the same result however it is run: serially, on a process pool, and as the
code before the throughput work did (a digest recorded from it on the same corpus).

The corpus mixes what production sends: failures and sampled successes of a toolcalc loop
(repeated requests, metadata with emails and phone numbers, unverifiable requests, a broken
body), and a question-answer loop whose variants are near duplicates or share a cluster.
Batches are small so decisions cross batch boundaries through the stored LSH bands.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from services.curation.workers import PreparePool
from services.db.session import SessionFactory
from services.environments.base import build_trace
from services.environments.toolcalc import ToolcalcEnvironment
from services.environments.toolcalc.tasks import sample_request
from tests.services.curation.support import (
    QaAdapter,
    add_traces,
    curate_all,
    make_loop,
    trace_body,
)

# sha256 of :func:`outcome` for the corpus below, recorded with the serial code before the
# throughput work (commit a0cb18f plus the held-out split rule that also samples successes,
# from the honest-points work: its serial code gives exactly this digest). A change here
# means curation decides differently.
RECORDED_DIGEST = "37dada41dfd6973465f2df15d037910600061362937900f2630c913b7e498bcd"

WORDS = [
    *("order", "refund", "invoice", "account", "login", "delivery", "address", "parcel"),
    *("broken", "missing", "late", "export", "report", "timeout", "plan", "premium", "cancel"),
    *("upgrade", "billing", "charge", "twice", "reset", "link", "expired", "courier"),
]


def toolcalc_bodies(n: int, *, seed: int) -> Iterator[Any]:
    env = ToolcalcEnvironment()
    rng = random.Random(seed)
    seen: list[str] = []
    for index in range(n):
        api = rng.choice(("v2", "v3"))
        failed = rng.random() < 0.75
        if failed and seen and rng.random() < 0.35:
            request = rng.choice(seen)
        elif rng.random() < 0.03:
            request = f"what is the weather in city {index}"
        else:
            request = sample_request(rng)
            seen.append(request)
        metadata: dict[str, Any] = {"api_version": api, "session": f"s-{index // 7}"}
        if failed and rng.random() < 0.15:
            metadata["customer"] = f"user{index}@example.com, +1 (555) 010-{index % 10000:04d}"
        external_id = f"tc-{index}"
        if index % 97 == 0:
            yield {"schema": "ratchet.trace/v1", "external_id": external_id, "messages": []}
            continue
        try:
            task = env.make_task(request, api)
        except ValueError:
            yield trace_body(external_id, request, answer=None, metadata=metadata)
            continue
        answer = "ans 0" if failed else f"ans {task.reference_answer}"
        episode = env.run_episode(task, lambda _, said=answer: said, max_turns=2)
        yield build_trace(
            task,
            episode,
            env.verify(task, episode),
            external_id=external_id,
            model_version="champion-1",
            metadata=metadata,
        )


def qa_bodies(n: int, *, seed: int) -> Iterator[Any]:
    rng = random.Random(seed)
    bases = [" ".join(rng.choices(WORDS, k=9)) for _ in range(n // 3)]
    for index in range(n):
        base = bases[index % len(bases)]
        variant = index // len(bases)
        suffix = ["", " today", " please help"][variant % 3]
        answer = f"a{index % len(bases)}" if variant != 2 else f"b{index}"
        meta: dict[str, Any] = {"note": f"call me at 555-010-{index:04d}"} if index % 11 else {}
        if index % 13 == 0:
            suffix += f" (mail me: user{index}@example.com)"
        if index % 29 == 0:
            meta["explode"] = True
        if index % 31 == 0:
            answer = f"owner{index}@example.com"
        yield trace_body(f"qa-{index}", base + suffix, answer=answer, metadata=meta)


def outcome(session_factory: SessionFactory) -> str:
    """Every decision curation wrote, as one digest: verdicts, tasks, sources, LSH bands."""
    queries = {
        "traces": "SELECT loop_id, external_id, curation_outcome, curation_detail FROM traces"
        " ORDER BY id",
        "tasks": "SELECT id, loop_id, content_hash, environment, spec, origin, cluster_id, split,"
        " weight, failure_signature, redactions, encode(minhash, 'hex') FROM tasks ORDER BY id",
        "sources": "SELECT task_id, trace_id, relation FROM task_sources"
        " ORDER BY task_id, trace_id",
        "bands": "SELECT loop_id, band, encode(bucket, 'hex'), task_id FROM lsh_buckets"
        " ORDER BY loop_id, band, bucket, task_id",
    }
    with session_factory() as session:
        state = {
            name: [list(row) for row in session.execute(text(sql)).all()]
            for name, sql in queries.items()
        }
    blob = json.dumps(state, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def load_corpus(session_factory: SessionFactory) -> tuple[int, int]:
    toolcalc = make_loop(
        session_factory,
        "calc",
        environment="toolcalc",
        curation_policy={"success_sample_rate": 0.3, "eval_fraction": 0.25},
    )
    qa = make_loop(
        session_factory,
        "support",
        curation_policy={
            "cluster_threshold": 0.6,
            "near_duplicate_threshold": 0.8,
            "heldout_max_tasks": 6,
        },
    )
    add_traces(session_factory, toolcalc, toolcalc_bodies(700, seed=3))
    add_traces(session_factory, qa, qa_bodies(240, seed=4))
    return toolcalc, qa


@pytest.mark.parametrize("processes", [1, 2])
def test_curation_matches_the_recorded_serial_result(
    session_factory: SessionFactory, processes: int
) -> None:
    toolcalc, qa = load_corpus(session_factory)
    with PreparePool(processes) as pool:
        curate_all(session_factory, toolcalc, adapter=ToolcalcEnvironment(), limit=70, pool=pool)
        curate_all(session_factory, qa, adapter=QaAdapter(), limit=70, pool=pool)
    assert outcome(session_factory) == RECORDED_DIGEST
