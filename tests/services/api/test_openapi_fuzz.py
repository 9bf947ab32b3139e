"""Fuzzing the api with schemathesis and hand-made hostile bodies: never a 5xx.

Bounded: a few seeded examples per operation. Every operation of /openapi.json is fuzzed
twice, with the admin token and with no credentials at all (everything must be refused
cleanly), against a real Temporal dev server, so the admin routes reach their real code
instead of stopping at "Temporal unavailable". The webhook is also fuzzed with each
generated body signed with the loop's real secret, so generated traces reach the parser, the
validator and the writer. Then the ingest doors get bodies written to hurt: gzip bombs and
many-member gzip, deep nesting, numbers and strings past every limit, bad encodings and
headers. (Attribute values that hold JSON inside OTLP spans belong to the OTLP mapping's own
tests.)
"""

from __future__ import annotations

import asyncio
import gzip
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import APIOperation, Case
from schemathesis.core.result import Ok
from temporalio.testing import WorkflowEnvironment

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from tests.services.api.support import (
    ADMIN_TOKEN,
    create_loop,
    make_trace,
    serve,
    signed_headers,
)

FUZZ = settings(
    max_examples=15,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
UNAUTHENTICATED = settings(FUZZ, max_examples=5)


def fuzz_operation(
    operation: APIOperation,
    url: str,
    headers: dict[str, str],
    server_errors: list[str],
    budget: settings,
) -> None:
    """Send generated cases of one operation as schemathesis builds them; record any 5xx."""

    @budget
    @given(case=operation.as_strategy())
    def fuzz(case: Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=30)
        if response.status_code >= 500:
            server_errors.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")

    fuzz()


def hostile_json_bodies() -> Iterator[tuple[str, bytes]]:
    trace = make_trace("hostile")
    yield "empty", b""
    yield "truncated", b'{"schema": "ratchet.trace/v1", "messages": ['
    yield "deep arrays", b"[" * 100_000 + b"]" * 100_000
    yield "deep objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    yield "huge integer", b'{"traces": [' + b"9" * 10_000 + b"]}"
    yield (
        "huge exponent",
        json.dumps({**trace, "outcome": {"success": False}})
        .encode()
        .replace(b'"success": false', b'"success": false, "score": 1e999999'),
    )
    yield "nan and infinity", b'{"schema": "ratchet.trace/v1", "x": NaN, "y": -Infinity}'
    yield "not utf-8", b'{"external_id": "\xff\xfe\xfa"}'
    yield "lone surrogate", json.dumps({**trace, "external_id": "\ud800x"}).encode()
    yield "nul bytes", json.dumps({**trace, "external_id": "a\u0000b"}).encode()
    yield "very long id", json.dumps({**trace, "external_id": "x" * 100_000}).encode()
    yield (
        "deep metadata",
        json.dumps({**trace, "metadata": {"m": json.loads("[" * 900 + "]" * 900)}}).encode(),
    )
    yield "wrong types", json.dumps({**trace, "messages": "none", "tools": {"a": 1}}).encode()
    yield "null", b"null"
    yield "a string", b'"trace"'
    yield "too many traces", json.dumps({"traces": [trace] * 2_000}).encode()


def hostile_gzip_bodies() -> Iterator[tuple[str, bytes]]:
    yield "gzip bomb", gzip.compress(b"\0" * 60_000_000, compresslevel=9)
    yield "many members", gzip.compress(b"") * 200_000
    yield "truncated gzip", gzip.compress(b'{"a": 1}' * 1000)[:-20]
    yield "not gzip", b"\x1f\x8b but not really"


def post(http: httpx.Client, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return http.post(path, content=body, headers=headers, timeout=120)


def hostile_requests(http: httpx.Client, loop: dict[str, Any], server_errors: list[str]) -> None:
    webhook = f"/v1/loops/{loop['name']}/traces"
    otlp_auth = {"authorization": f"Bearer {loop['ingest_token']}"}
    sent: list[tuple[str, httpx.Response]] = []

    for name, body in hostile_json_bodies():
        sent.append((f"webhook unsigned {name}", post(http, webhook, body, {})))
        signed = signed_headers(loop["signing_secret"], body)
        sent.append((f"webhook signed {name}", post(http, webhook, body, signed)))
        json_otlp = {**otlp_auth, "content-type": "application/json"}
        sent.append((f"otlp json {name}", post(http, "/otlp/v1/traces", body, json_otlp)))
    for name, packed in hostile_gzip_bodies():
        signed = signed_headers(loop["signing_secret"], b"")
        signed["content-encoding"] = "gzip"
        sent.append((f"webhook {name}", post(http, webhook, packed, signed)))
        gzip_otlp = {
            **otlp_auth,
            "content-type": "application/x-protobuf",
            "content-encoding": "gzip",
        }
        sent.append((f"otlp {name}", post(http, "/otlp/v1/traces", packed, gzip_otlp)))
    protobuf = {**otlp_auth, "content-type": "application/x-protobuf"}
    for name, body in [
        ("random bytes", uuid.uuid4().bytes * 1000),
        ("truncated message", b"\x0a\xff\xff\xff\x0f"),
        ("huge length prefix", b"\x0a\xff\xff\xff\xff\x07" + b"x" * 10),
        ("deep nesting", b"\x0a\x02" * 50_000),
    ]:
        sent.append((f"otlp protobuf {name}", post(http, "/otlp/v1/traces", body, protobuf)))
    header_cases: list[tuple[str, dict[str, str]]] = [
        ("bad content-length", {"content-length": "abc"}),
        ("negative content-length", {"content-length": "-5"}),
        ("unknown encoding", {"content-encoding": "br"}),
        ("stacked encodings", {"content-encoding": "gzip, gzip"}),
        ("latin-1 charset", {"content-type": "application/json; charset=latin-1"}),
        ("bogus signature", {"webhook-signature": "v1," + "A" * 10_000}),
        ("far-future timestamp", {"webhook-timestamp": "9" * 12}),
        ("huge webhook-id", {"webhook-id": "i" * 5_000}),
    ]
    for name, extra in header_cases:
        headers = {**signed_headers(loop["signing_secret"], b"{}"), **extra}
        try:
            response = http.post(webhook, content=b"{}", headers=headers, timeout=30)
        except httpx.HTTPError:
            continue  # refused at the protocol level (h11), which is not a server error
        sent.append((f"webhook header {name}", response))
    for path in ("/v1/loops/..%2f..%2fetc/traces", "/v1/loops/%00/traces", "/v1/loops/a/traces"):
        sent.append((f"webhook path {path}", post(http, path, b"{}", {})))

    for name, response in sent:
        if response.status_code >= 500:
            server_errors.append(f"{name}: {response.status_code} {response.text[:300]}")


async def test_fuzzing_the_api_finds_no_server_error(
    app_state: AppState, temporal_env: WorkflowEnvironment
) -> None:
    address = temporal_env.client.service_client.config.target_host
    fuzz_settings = app_state.settings.model_copy(
        update={
            "temporal_address": address,
            # No worker polls it: loops the fuzzer creates start workflows that only wait.
            "temporal_task_queue": f"fuzz-{uuid.uuid4().hex[:8]}",
        }
    )
    app_state.settings = fuzz_settings
    app_state.temporal = TemporalConnection(fuzz_settings)
    app = create_app(fuzz_settings, state=app_state)
    await asyncio.to_thread(run_fuzz, app)


def run_fuzz(app: Any) -> None:
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        loop = create_loop(http, "fuzz")
        schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
        operations = []
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result
            operations.append(result.ok())
        assert len(operations) >= 15
        server_errors: list[str] = []
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        for operation in operations:
            is_otlp = "/otlp/v1/" in operation.path
            auth = {"Authorization": f"Bearer {loop['ingest_token']}"} if is_otlp else admin
            fuzz_operation(operation, url, auth, server_errors, FUZZ)
            fuzz_operation(operation, url, {}, server_errors, UNAUTHENTICATED)

        webhook = next(
            op
            for op in operations
            if op.path.endswith("/traces") and "loops" in op.path and op.method.upper() == "POST"
        )

        @FUZZ
        @given(case=webhook.as_strategy())
        def fuzz_signed(case: Case) -> None:
            body = json.dumps(case.body).encode() if case.body is not None else b""
            response = http.post(
                f"/v1/loops/{loop['name']}/traces",
                content=body,
                headers=signed_headers(loop["signing_secret"], body),
            )
            if response.status_code >= 500:
                server_errors.append(f"signed webhook {body[:200]!r}: {response.text[:300]}")
            assert response.status_code in (200, 400, 413, 422), response.text

        fuzz_signed()

        # Configuration changes on a loop that exists, so bodies reach the merge and the
        # policy validation (a random name is only ever a 404).
        patch = next(op for op in operations if op.method.upper() == "PATCH")

        @FUZZ
        @given(case=patch.as_strategy())
        def fuzz_patch(case: Case) -> None:
            response = http.patch(
                f"/v1/loops/{loop['name']}",
                json=case.body,
                # Half dry runs, half real changes (versions are written too).
                params={"dry_run": "true"} if len(repr(case.body)) % 2 else None,
                headers=admin,
            )
            if response.status_code >= 500:
                server_errors.append(f"PATCH {case.body!r:.200}: {response.text[:300]}")
            assert response.status_code in (200, 422), response.text

        fuzz_patch()
        hostile_requests(http, loop, server_errors)
        assert server_errors == []
