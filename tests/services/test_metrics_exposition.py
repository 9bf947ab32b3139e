"""Ratchet's Prometheus exposition passes ``promtool check metrics`` (Debian's prometheus
package), and every metric is documented in docs/observability.md with its type and labels.

Both the api's ``/metrics`` and the worker's (Ratchet's registry plus the Temporal SDK's own
metrics) are checked, with every metric of the registry holding at least one sample so
promtool sees each family's real exposition, not only its HELP and TYPE lines.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from sqlalchemy import Engine
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

import services.metrics as metrics
from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.session import SessionFactory
from services.settings import Settings
from services.temporal import metrics_runtime
from workflows.worker import health_app

DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
SAMPLE_LABEL = "exposition-check"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is missing: install Debian's prometheus package (apt-get install prometheus)"
        )
    return path


def _check(promtool: str, exposition: str) -> None:
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and problems == "", problems


def ratchet_metrics() -> list[MetricWrapperBase]:
    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def exposed_name(metric: MetricWrapperBase) -> str:
    """The name as written in services/metrics.py (counters carry ``_total``)."""
    name = str(metric._name)
    return f"{name}_total" if metric._type == "counter" else name


def give_every_metric_a_sample() -> None:
    """One sample per family, under a label value no other test reads."""
    for metric in ratchet_metrics():
        names = metric._labelnames
        child = metric.labels(**{n: SAMPLE_LABEL for n in names}) if names else metric
        if isinstance(child, Counter):
            child.inc()
        elif isinstance(child, Gauge):
            child.set(1)
        elif isinstance(child, Histogram):
            child.observe(0.5)
        else:
            raise AssertionError(f"no sample rule for {type(child).__name__}")


def test_the_module_lists_every_registered_metric() -> None:
    assert len(ratchet_metrics()) == len(list(metrics.REGISTRY.collect()))


def test_api_metrics_pass_promtool(
    promtool: str,
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    tmp_path: Path,
) -> None:
    settings = Settings(database_url=database_url, state_dir=tmp_path)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with TestClient(create_app(settings, state=state)) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/").status_code == 200
        assert client.get("/loops/no-such-loop").status_code == 404
        give_every_metric_a_sample()
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    exposition = response.text
    for metric in ratchet_metrics():
        assert f"# TYPE {metric._name}" in exposition
    assert 'ratchet_http_requests_total{method="GET",route="/loops/{name}",status="404"}' in (
        exposition
    )
    _check(promtool, exposition)


@activity.defn
async def echo(value: str) -> str:
    return value


@workflow.defn(sandboxed=False)
class EchoWorkflow:
    """Just enough work for the SDK to record workflow, activity and poll metrics."""

    @workflow.run
    async def run(self, value: str) -> str:
        return await workflow.execute_activity(
            echo, value, start_to_close_timeout=timedelta(seconds=30)
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_worker_metrics_with_the_sdk_pass_promtool(
    promtool: str, temporal_env: WorkflowEnvironment, engine: Engine
) -> None:
    port = _free_port()
    runtime = metrics_runtime(f"127.0.0.1:{port}")
    address = temporal_env.client.service_client.config.target_host
    client = await Client.connect(address, runtime=runtime)
    task_queue = f"metrics-{uuid.uuid4().hex[:8]}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[EchoWorkflow],
        activities=[echo],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        assert (
            await client.execute_workflow(
                EchoWorkflow.run, "hi", id=f"metrics-{uuid.uuid4()}", task_queue=task_queue
            )
            == "hi"
        )
    give_every_metric_a_sample()
    app = health_app(engine, client, f"http://127.0.0.1:{port}/metrics")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://worker"
    ) as http:
        response = await http.get("/metrics")
    exposition = response.text
    assert "temporal_" in exposition and "ratchet_job_runs_total" in exposition
    _check(promtool, exposition)


def _documented() -> dict[str, tuple[str, frozenset[str]]]:
    """``| `name` | type | `label`, `label` | meaning |`` rows of docs/observability.md."""
    rows = re.findall(
        r"^\|\s*`(ratchet_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|([^|]*)\|",
        DOCS.read_text(encoding="utf-8"),
        flags=re.MULTILINE,
    )
    return {
        name: (kind, frozenset(re.findall(r"`([a-z_]+)`", labels))) for name, kind, labels in rows
    }


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    documented = _documented()
    actual = {exposed_name(m): (str(m._type), frozenset(m._labelnames)) for m in ratchet_metrics()}
    assert documented == actual
