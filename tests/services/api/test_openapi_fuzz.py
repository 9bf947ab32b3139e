"""Fuzzing the ingest and loop operations of /openapi.json with schemathesis: never a 5xx.

Bounded: a few seeded examples per operation. The webhook is fuzzed twice: as schemathesis
sends it (unsigned: every case must be refused cleanly) and with each generated body signed
with the loop's real secret, so generated traces reach the parser, the validator and the
writer.
"""

from __future__ import annotations

import json

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import APIOperation, Case
from schemathesis.core.result import Ok

from services.api.app import create_app
from services.api.state import AppState
from tests.services.api.support import ADMIN_TOKEN, create_loop, serve, signed_headers

OPERATIONS = {
    ("GET", "/v1/loops"),
    ("POST", "/v1/loops"),
    ("GET", "/v1/loops/{loop}"),
    ("POST", "/v1/loops/{loop}/secrets/rotate"),
    ("PATCH", "/v1/loops/{loop}"),
    ("GET", "/v1/loops/{loop}/config/versions"),
    ("POST", "/v1/loops/{loop}/traces"),
    ("POST", "/otlp/v1/traces"),
    ("POST", "/v1/otlp/v1/traces"),
    ("POST", "/otlp/v1/logs"),
    ("POST", "/v1/otlp/v1/logs"),
    ("GET", "/healthz"),
}
FUZZ = settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def fuzz_operation(
    operation: APIOperation, url: str, auth: dict[str, str], server_errors: list[str]
) -> None:
    """Send generated cases of one operation as schemathesis builds them; record any 5xx."""

    @FUZZ
    @given(case=operation.as_strategy())
    def fuzz(case: Case) -> None:
        response = case.call(base_url=url, headers=auth)
        if response.status_code >= 500:
            server_errors.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")

    fuzz()


def test_fuzzing_the_openapi_finds_no_server_error(app_state: AppState) -> None:
    app = create_app(app_state.settings, state=app_state)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        loop = create_loop(http, "fuzz")
        schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
        operations = []
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result
            operation = result.ok()
            if (operation.method.upper(), operation.path) in OPERATIONS:
                operations.append(operation)
        assert {(op.method.upper(), op.path) for op in operations} == OPERATIONS
        server_errors: list[str] = []
        headers = {
            "Authorization": f"Bearer {ADMIN_TOKEN}",
        }

        for operation in operations:
            is_otlp = "/otlp/v1/" in operation.path
            auth = {"Authorization": f"Bearer {loop['ingest_token']}"} if is_otlp else headers
            fuzz_operation(operation, url, auth, server_errors)

        webhook = next(
            op for op in operations if op.path.endswith("/traces") and "loops" in op.path
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
                headers=headers,
            )
            if response.status_code >= 500:
                server_errors.append(f"PATCH {case.body!r:.200}: {response.text[:300]}")
            assert response.status_code in (200, 422), response.text

        fuzz_patch()
        assert server_errors == []
