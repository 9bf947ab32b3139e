"""Temporal client factory and Ratchet's custom search attributes.

Search attributes turn the Temporal Web UI into a usable dashboard: list every workflow of a
loop (``RatchetLoop = "support-bot"``) or every loop in a given stage.
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client, TLSConfig
from temporalio.common import SearchAttributeKey
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from services.settings import Settings

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

_DEV_SERVER_TYPE_NAMES: dict[int, str] = {
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD: "Keyword",
    IndexedValueType.INDEXED_VALUE_TYPE_INT: "Int",
}


def dev_server_search_attribute_args() -> list[str]:
    """``--search-attribute Name=Type`` arguments for ``temporal server start-dev``."""
    args: list[str] = []
    for key in SEARCH_ATTRIBUTES:
        type_name = _DEV_SERVER_TYPE_NAMES[int(key.indexed_value_type)]
        args += ["--search-attribute", f"{key.name}={type_name}"]
    return args


def _tls_config(settings: Settings) -> TLSConfig | bool:
    if not settings.temporal_tls:
        return False

    def read(path: object) -> bytes | None:
        from pathlib import Path

        return Path(str(path)).read_bytes() if path is not None else None

    return TLSConfig(
        server_root_ca_cert=read(settings.temporal_tls_ca_cert),
        client_cert=read(settings.temporal_tls_client_cert),
        client_private_key=read(settings.temporal_tls_client_key),
    )


def metrics_runtime(bind_address: str) -> Runtime:
    """A Temporal core runtime that exports the SDK's own metrics in Prometheus format."""
    prometheus = PrometheusConfig(
        bind_address=bind_address,
        counters_total_suffix=True,
        unit_suffix=True,
        durations_as_seconds=True,
    )
    return Runtime(telemetry=TelemetryConfig(metrics=prometheus))


async def connect_temporal(settings: Settings, *, runtime: Runtime | None = None) -> Client:
    """Connect to the configured Temporal frontend (the embedded dev server by default)."""
    api_key = settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None
    return await Client.connect(
        settings.effective_temporal_address,
        namespace=settings.temporal_namespace,
        tls=_tls_config(settings),
        api_key=api_key,
        runtime=runtime,
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
