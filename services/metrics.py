"""Every Prometheus metric Ratchet exports, in one registry.

Names follow ``ratchet_<subsystem>_<name>_<unit>``; labels are low-cardinality (loop yes,
run id never). The api and the worker both serve this registry at ``/metrics``; the worker
also serves the Temporal SDK's own metrics.

An api of several processes (``RATCHET_API_WORKERS`` > 1) uses prometheus_client's
multi-process mode: ``ratchet api`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory
before its workers start, each worker writes its values there, and ``/metrics``, whichever
worker answers, sums them.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

# Read by prometheus_client when it is imported: set it before a worker process starts.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_JOB_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)

# HTTP ---------------------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    "ratchet_http_requests_total",
    "HTTP requests served, by route template, method and status code.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
HTTP_REQUEST_DURATION = Histogram(
    "ratchet_http_request_duration_seconds",
    "HTTP request latency by route template.",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)

# Ingest -------------------------------------------------------------------------------------
INGEST_RECEIVED = Counter(
    "ratchet_ingest_traces_received_total",
    "Traces received (before validation), by loop and door (webhook, otlp).",
    ["loop", "source"],
    registry=REGISTRY,
)
INGEST_ACCEPTED = Counter(
    "ratchet_ingest_traces_accepted_total",
    "Traces made durable in Postgres.",
    ["loop", "source"],
    registry=REGISTRY,
)
INGEST_DUPLICATE = Counter(
    "ratchet_ingest_traces_duplicate_total",
    "Traces whose (loop, external id) was already stored; answered as a no-op.",
    ["loop", "source"],
    registry=REGISTRY,
)
INGEST_REJECTED = Counter(
    "ratchet_ingest_traces_rejected_total",
    "Traces or requests rejected, by reason.",
    ["loop", "source", "reason"],
    registry=REGISTRY,
)
INGEST_BYTES = Counter(
    "ratchet_ingest_bytes_total",
    "Request body bytes received (after decompression).",
    ["source"],
    registry=REGISTRY,
)
INGEST_COMMIT_DURATION = Histogram(
    "ratchet_ingest_commit_duration_seconds",
    "Time of one group commit of traces.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INGEST_COMMIT_ROWS = Histogram(
    "ratchet_ingest_commit_rows",
    "Traces written per group commit.",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
    registry=REGISTRY,
)
INGEST_QUEUE_DEPTH = Gauge(
    "ratchet_ingest_queue_depth",
    "Traces waiting for the group-commit writer.",
    multiprocess_mode="livesum",  # all api workers' queues together
    registry=REGISTRY,
)

# Retention ----------------------------------------------------------------------------------
TRACE_BODIES_PURGED = Counter(
    "ratchet_retention_trace_bodies_purged_total",
    "Raw trace bodies dropped after RATCHET_TRACE_RETENTION_DAYS (the rows stay); the "
    "planner's estimate of the rows of each partition dropped.",
    registry=REGISTRY,
)
PARTITIONS_CREATED = Counter(
    "ratchet_partitions_created_total",
    "Partitions made ahead of time (RATCHET_PARTITIONS_AHEAD), by table.",
    ["table"],
    registry=REGISTRY,
)
PARTITIONS_RETIRED = Counter(
    "ratchet_partitions_retired_total",
    "Partitions detached and dropped by retention, by table.",
    ["table"],
    registry=REGISTRY,
)
PARTITION_RETIREMENT_DURATION = Histogram(
    "ratchet_partitions_retirement_duration_seconds",
    "One retirement transaction of a partitioned table (detach, drop, default partition).",
    ["table"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)

# Curation -----------------------------------------------------------------------------------
CURATION_TRACES = Counter(
    "ratchet_curation_traces_total",
    "Traces curated, by outcome (task, duplicate, rejected, skipped).",
    ["loop", "outcome"],
    registry=REGISTRY,
)
CURATION_REJECTED = Counter(
    "ratchet_curation_rejected_total",
    "Traces the environment adapter could not turn into a task, by reason.",
    ["loop", "reason"],
    registry=REGISTRY,
)
CURATION_REDACTIONS = Counter(
    "ratchet_curation_redactions_total",
    "Sensitive values redacted from tasks, by kind.",
    ["loop", "kind"],
    registry=REGISTRY,
)
CURATION_PHASE_SECONDS = Counter(
    "ratchet_curation_phase_seconds_total",
    "Seconds curation batches spent per phase (lock, prepare, lookup, dedup, write); "
    "lock, lookup and write are time on Postgres.",
    ["loop", "phase"],
    registry=REGISTRY,
)
LOOP_FAILURE_RATE = Gauge(
    "ratchet_loop_live_failure_rate",
    "Rolling failure rate of the served model from ingested traces.",
    ["loop"],
    registry=REGISTRY,
)

# Jobs ---------------------------------------------------------------------------------------
JOB_RUNS = Counter(
    "ratchet_job_runs_total",
    "Jobs finished, by kind (train, eval, probe), executor and final status.",
    ["loop", "kind", "executor", "status"],
    registry=REGISTRY,
)
JOB_DURATION = Histogram(
    "ratchet_job_duration_seconds",
    "Wall time of jobs from start to finish.",
    ["kind", "executor"],
    buckets=_JOB_BUCKETS,
    registry=REGISTRY,
)
JOB_COMPUTE_SECONDS = Counter(
    "ratchet_job_compute_seconds_total",
    "Accelerator-or-CPU seconds billed to jobs.",
    ["loop", "kind"],
    registry=REGISTRY,
)
JOB_COST = Counter(
    "ratchet_job_cost_usd_total",
    "Dollars of compute spent on jobs.",
    ["loop", "kind"],
    registry=REGISTRY,
)
JOB_TOKENS_PER_SECOND = Gauge(
    "ratchet_job_tokens_per_second",
    "Throughput reported by the last job of a kind (train tokens/s, rollout tokens/s).",
    ["loop", "kind", "phase"],
    registry=REGISTRY,
)

# Loop ---------------------------------------------------------------------------------------
LOOP_CYCLES = Counter(
    "ratchet_loop_cycles_total",
    "Cycles finished, by outcome (promoted, rejected, rolled_back, failed, no_data).",
    ["loop", "outcome"],
    registry=REGISTRY,
)
LOOP_PROMOTIONS = Counter(
    "ratchet_loop_promotion_decisions_total",
    "Gate decisions, by decision (promote, reject, rollback).",
    ["loop", "decision"],
    registry=REGISTRY,
)
LOOP_PASS_RATE = Gauge(
    "ratchet_loop_pass_rate_ratio",
    "Offline pass rate of the champion and the latest candidate on the eval set.",
    ["loop", "role"],
    registry=REGISTRY,
)
LOOP_SPEND = Gauge(
    "ratchet_loop_spend_usd",
    "Cumulative compute spend of a loop.",
    ["loop"],
    registry=REGISTRY,
)
LOOP_POINTS_PER_DOLLAR = Gauge(
    "ratchet_loop_points_per_dollar",
    "Cumulative pass-rate points gained per dollar (intelligence per dollar).",
    ["loop"],
    registry=REGISTRY,
)
LOOP_STAGE_DURATION = Histogram(
    "ratchet_loop_stage_duration_seconds",
    "Wall time of each stage of a cycle.",
    ["loop", "stage"],
    buckets=_JOB_BUCKETS,
    registry=REGISTRY,
)

# Serving ------------------------------------------------------------------------------------
SERVING_REQUESTS = Counter(
    "ratchet_serving_requests_total",
    "Requests to the local model server, by status code class.",
    ["status"],
    registry=REGISTRY,
)
SERVING_REQUEST_DURATION = Histogram(
    "ratchet_serving_request_duration_seconds",
    "Latency of the model server's chat completions (to the last token).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
SERVING_SWAPS = Counter(
    "ratchet_serving_swaps_total",
    "Hot swaps of the served checkpoint, by result (ok, rejected).",
    ["result"],
    registry=REGISTRY,
)
SERVING_TOKENS = Counter(
    "ratchet_serving_tokens_total",
    "Tokens the model server read (prompt, once per request) and generated (completion), "
    "by served version (the checkpoint id: one per promotion, so few).",
    ["version", "kind"],
    registry=REGISTRY,
)
SERVING_PROMPT_TOKENS = Counter(
    "ratchet_serving_prompt_tokens_total",
    "Prompt tokens of the model server's rows, by served version and source: cached (keys "
    "and values reused from the prefix cache) or computed (prefilled).",
    ["version", "source"],
    registry=REGISTRY,
)
SERVING_BUSY_SECONDS = Counter(
    "ratchet_serving_busy_seconds_total",
    "Wall seconds the model server's engine spent prefilling and decoding a version's rows "
    "(a batch's time shared among its rows: see services.modelserver.usage).",
    ["version"],
    registry=REGISTRY,
)
SERVING_SWAP_DURATION = Histogram(
    "ratchet_serving_swap_duration_seconds",
    "Time from a deploy request to the new version being served.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


# Gateway ------------------------------------------------------------------------------------
_GATEWAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
GATEWAY_REQUESTS = Counter(
    "ratchet_gateway_requests_total",
    "Requests the capture gateway answered, by loop, route and status code class.",
    ["loop", "route", "status"],
    registry=REGISTRY,
)
GATEWAY_CAPTURED = Counter(
    "ratchet_gateway_captured_total",
    "Calls written to the gateway's spool (durable against a killed process).",
    ["loop"],
    registry=REGISTRY,
)
GATEWAY_DROPPED = Counter(
    "ratchet_gateway_dropped_total",
    "Calls answered but not captured, by reason (spool_full, spool_error).",
    ["loop", "reason"],
    registry=REGISTRY,
)
GATEWAY_STORED = Counter(
    "ratchet_gateway_stored_total",
    "Captured calls the gateway's writer moved from its spool into Postgres.",
    registry=REGISTRY,
)
GATEWAY_SPOOL_BYTES = Gauge(
    "ratchet_gateway_spool_bytes",
    "Bytes of captured calls in this replica's spool not yet in Postgres.",
    registry=REGISTRY,
)
GATEWAY_OVERHEAD = Histogram(
    "ratchet_gateway_overhead_seconds",
    "The gateway's own time per request: from the request's arrival to the answer's last "
    "byte, less the time spent waiting on the upstream.",
    ["route"],
    buckets=_GATEWAY_BUCKETS,
    registry=REGISTRY,
)
GATEWAY_SESSIONS_CLOSED = Counter(
    "ratchet_gateway_sessions_closed_total",
    "Sessions closed into traces, by loop and why (idle, api).",
    ["loop", "reason"],
    registry=REGISTRY,
)


def multiprocess() -> bool:
    """Whether this process keeps its values for a multi-process api (see the docstring)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


def render_latest() -> tuple[bytes, str]:
    """The registry in Prometheus text format, with its content type (all api workers'
    values summed in multi-process mode)."""
    if multiprocess():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def forget_this_process() -> None:
    """At a worker's exit: its live gauges (the queue depth) stop counting. Counters and
    histograms keep what it counted."""
    if multiprocess():
        mark_process_dead(os.getpid())
