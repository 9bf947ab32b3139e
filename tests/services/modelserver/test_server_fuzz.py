"""Fuzzing the model server's routes with schemathesis (tiny-family checkpoint): never a 5xx.

Bounded (a few seeded examples per operation), as tests/services/api/test_openapi_fuzz.py
does for the api: every operation of the server's OpenAPI schema, with and without the API
key, plus bodies written to hurt."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import APIOperation, Case
from schemathesis.core.result import Ok

from services.metrics import SERVING_REQUESTS
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import ServerThread

Serve = Callable[..., ServerThread]
FUZZ = settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
KEY = "fuzz-key"


def fuzz_operation(
    operation: APIOperation, url: str, headers: dict[str, str], errors: list[str]
) -> None:
    @FUZZ
    @given(case=operation.as_strategy())
    def fuzz(case: Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=60)
        if response.status_code >= 500:
            errors.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")

    fuzz()


HOSTILE = [
    b"",
    b"{",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"model": "ratchet", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "ratchet", "messages": [{"role": "user", "content": 1e999999}]}',
    b'{"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "n": NaN}',
    b'{"model": "ratchet", "messages": [{"role": "user", "content": "a\\u0000b"}]}',
    b'{"model": "ratchet", "messages": [{"role": "tool", "content": "1", "tool_call_id": "'
    + b"x" * 100_000
    + b'"}]}',
    json.dumps(
        {"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}
    ).encode(),
    b"\xff\xfe\xfa",
]


def test_fuzzing_the_model_server_finds_no_server_error(
    serve: Serve, checkpoints: list[CheckpointRef]
) -> None:
    errors: list[str] = []
    before = answered()
    for api_key in (None, KEY):
        server = serve(checkpoints[0], api_key=api_key, max_body_bytes=64 * 1024)
        schema = schemathesis.openapi.from_dict(server.app.openapi())
        operations = []
        for result in schema.get_all_operations():
            assert isinstance(result, Ok), result
            operations.append(result.ok())
        paths = {operation.path for operation in operations}
        assert {"/v1/chat/completions", "/v1/load_lora_adapter", "/v1/models"} <= paths
        auth = {"Authorization": f"Bearer {KEY}"} if api_key else {}
        for operation in operations:
            fuzz_operation(operation, server.url, auth, errors)
            if api_key:
                fuzz_operation(operation, server.url, {}, errors)
        for body in HOSTILE:
            for path in ("/v1/chat/completions", "/v1/load_lora_adapter"):
                response = httpx.post(
                    f"{server.url}{path}",
                    content=body,
                    headers={**auth, "content-type": "application/json"},
                    timeout=60,
                )
                if response.status_code >= 500:
                    errors.append(f"hostile {body[:40]!r} to {path}: {response.text[:300]}")
    assert errors == []
    assert answered() - before > 150  # the cases were really sent (and answered)


def answered() -> float:
    """Requests the model servers of this process answered, by the door's own counter."""
    return sum(SERVING_REQUESTS.labels(kind)._value.get() for kind in ("2xx", "4xx"))
