"""ServingLedgerWorkflow: one sample of every serving loop's model-server counters.

Deploys, rollbacks and cycle closes sample the serving ledger on their own (a tenure ends
exactly at its replacement); between them a Temporal Schedule (``ratchet-serving-ledger``,
set up by the worker, see workflows.schedules) starts this every
``RATCHET_SERVING_LEDGER_SAMPLE_S`` seconds, so the serving champion's tokens, compute and
$/Mtok are never older than that on the dashboard. Counters are per version and cumulative:
a missed sample loses nothing, the next one adds the growth.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.activities.serving_ledger import ServingLedgerActivities
    from workflows.options import LEDGER_SAMPLE, long_activity
    from workflows.payloads.ledger import ServingLedgerInput, ServingLedgerResult


@workflow.defn(name="ServingLedgerWorkflow")
class ServingLedgerWorkflow:
    @workflow.run
    async def run(self, input: ServingLedgerInput) -> ServingLedgerResult:
        return await long_activity(
            ServingLedgerActivities.sample_serving_ledgers, input, LEDGER_SAMPLE
        )
