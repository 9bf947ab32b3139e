"""Ratchet's custom search attributes: the keys the workflows set, and their registration.

They turn the Temporal Web UI into a usable dashboard: list every workflow of a loop
(``RatchetLoop = "support-bot"``), every loop in a given stage, every cycle by outcome. The
keys live with the workflows that set them; the worker registers them in its namespace at
start (:func:`ensure_search_attributes`), before it takes any workflow task that sets one.
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.common import SearchAttributeKey

RATCHET_LOOP = SearchAttributeKey.for_keyword("RatchetLoop")
RATCHET_STAGE = SearchAttributeKey.for_keyword("RatchetStage")
RATCHET_CYCLE = SearchAttributeKey.for_int("RatchetCycle")
RATCHET_OUTCOME = SearchAttributeKey.for_keyword("RatchetOutcome")

SEARCH_ATTRIBUTES: tuple[SearchAttributeKey, ...] = (
    RATCHET_LOOP,
    RATCHET_STAGE,
    RATCHET_CYCLE,
    RATCHET_OUTCOME,
)


async def ensure_search_attributes(client: Client, namespace: str) -> list[str]:
    """Register Ratchet's search attributes where missing; returns the names added."""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    missing = {
        key.name: IndexedValueType.ValueType(int(key.indexed_value_type))
        for key in SEARCH_ATTRIBUTES
        if key.name not in existing.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
    return sorted(missing)
