"""Temporal client factory: the connection (TLS, API key) and the SDK's metrics runtime.

Ratchet's custom search attributes are the workflows' (workflows/search_attributes.py): the
worker registers them in its namespace at start.
"""

from __future__ import annotations

from temporalio.client import Client, TLSConfig
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from services.settings import Settings


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
