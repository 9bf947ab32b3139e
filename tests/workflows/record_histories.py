"""Record workflow histories for the replay gate: ``python -m tests.workflows.record_histories``.

Runs the loop's scenarios against a fresh Temporal dev server (with the typed activity fakes
of test_loop.py) and writes each workflow's history — the loop and its child workflows —
under tests/workflows/histories/. Re-record only for a deliberate, versioned change; the
committed files are what running workflows in production look like.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from services.local.binaries import temporal_cli_path
from services.temporal import SEARCH_ATTRIBUTES
from tests.workflows.test_loop import LiveStats, World, make_worker, start_loop
from workflows.shared import cycle_workflow_id

HISTORIES = Path(__file__).parent / "histories"


async def _record(client: Client, scenario: str, world: World) -> None:
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    name = f"rec-{scenario}"
    async with make_worker(client, task_queue, world):
        handle = await start_loop(client, task_queue, name, max_cycles=1)
        await handle.result()
    ids = [f"loop/{name}"] + [
        cycle_workflow_id(name, 1, stage) for stage in ("train", "evaluate", "promote")
    ]
    for workflow_id in ids:
        try:
            history = await client.get_workflow_handle(workflow_id).fetch_history()
        except Exception:
            continue
        stage = workflow_id.rsplit("/", 1)[-1] if "/cycle/" in workflow_id else "loop"
        path = HISTORIES / f"{stage}-{scenario}.json"
        path.write_text(history.to_json())
        print(f"wrote {path}")


async def main() -> None:
    HISTORIES.mkdir(exist_ok=True)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_cli_path()),
        search_attributes=SEARCH_ATTRIBUTES,
        ui=False,
    )
    try:
        await _record(env.client, "promoted", World(new_tasks=12))
        await _record(env.client, "rejected", World(new_tasks=12, gate_decision="reject"))
        await _record(
            env.client,
            "rolled-back",
            World(
                new_tasks=12,
                candidate_live=LiveStats(40, 4, 0.1, 0.04, 0.23),
                baseline_live=LiveStats(40, 32, 0.8, 0.65, 0.9),
            ),
        )
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
