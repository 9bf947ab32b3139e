"""Payloads of the serving ledger's scheduled sampling."""

from __future__ import annotations

from dataclasses import dataclass

SERVING_LEDGER_SCHEDULE_ID = "ratchet-serving-ledger"


SERVING_LEDGER_WORKFLOW_ID = "serving-ledger/sample"


@dataclass
class ServingLedgerInput:
    """One sample of every serving loop's model server counters into its open tenure."""

    max_loops: int = 1000


@dataclass
class ServingLedgerResult:
    sampled: int = 0  # loops whose server's counters were read and added
    unreadable: int = 0  # loops whose server could not be read (logged; the next sample)
