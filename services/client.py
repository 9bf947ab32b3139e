"""A small typed client of Ratchet's HTTP API: the loop admin API, the traces listing and
signed trace posting.

Used by the ``ratchet loop`` and ``ratchet traces`` commands and by ``ratchet demo`` (which
posts simulated production traffic with :func:`sign_and_post_traces`, signed exactly as an
agent runtime would sign it with the Standard Webhooks scheme).
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel
from standardwebhooks.webhooks import Webhook

from services.api.schemas.ledger import ServingLedgerPublic
from services.api.schemas.loops import (
    LoopConfigChange,
    LoopConfigVersionPublic,
    LoopCreated,
    LoopDetail,
    LoopPublic,
    RotateResult,
)
from services.api.schemas.traces import IngestResult, TraceDetail, TracePage

T = TypeVar("T", bound=BaseModel)


class ApiUnreachable(Exception):
    """The api did not answer (not running, wrong URL, network)."""


class ApiRequestError(Exception):
    """The api answered with an error: its status, code and message."""

    def __init__(
        self, status_code: int, code: str, message: str, fields: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.fields = fields or []


def _raise_for_error(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        code, message, fields = error["code"], error["message"], error.get("fields", [])
    except (ValueError, KeyError, TypeError):
        code, message, fields = "http_error", response.text[:500] or response.reason_phrase, []
    raise ApiRequestError(response.status_code, code, message, fields)


class RatchetClient:
    """The admin API with an admin token. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        base_url: str,
        admin_token: str | None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> RatchetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=json_body, params=params)
        except httpx.TransportError as exc:
            raise ApiUnreachable(f"cannot reach the Ratchet api at {self.base_url}: {exc}") from exc
        _raise_for_error(response)
        return response

    def _model(
        self,
        model: type[T],
        method: str,
        path: str,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> T:
        return model.model_validate(self._request(method, path, json_body, params).json())

    def _models(
        self, model: type[T], path: str, params: Mapping[str, str] | None = None
    ) -> list[T]:
        """The items of a JSON array a ``GET`` answers with, each validated as ``model``."""
        return [
            model.model_validate(item) for item in self._request("GET", path, None, params).json()
        ]

    def _object(self, method: str, path: str, json_body: Any = None) -> dict[str, Any]:
        """The JSON object an endpoint without a response model answers with."""
        result: dict[str, Any] = self._request(method, path, json_body).json()
        return result

    def create_loop(
        self,
        name: str,
        environment: str,
        *,
        executor: str | None = "local",
        budget_usd: Decimal | float | None = None,
        training_profile: Mapping[str, Any] | None = None,
        serving_target: Mapping[str, Any] | None = None,
        gate_policy: Mapping[str, Any] | None = None,
        trigger_policy: Mapping[str, Any] | None = None,
        curation_policy: Mapping[str, Any] | None = None,
        changed_by: str | None = None,
    ) -> LoopCreated:
        """Create a loop; the answer holds its signing secret and ingest token (shown once)."""
        body: dict[str, Any] = {"name": name, "environment": environment}
        if executor is not None:  # None: the server's RATCHET_EXECUTOR
            body["executor"] = executor
        if changed_by:
            body["changed_by"] = changed_by
        if budget_usd is not None:
            body["budget_usd"] = str(budget_usd)
        for key, value in (
            ("training_profile", training_profile),
            ("serving_target", serving_target),
            ("gate_policy", gate_policy),
            ("trigger_policy", trigger_policy),
            ("curation_policy", curation_policy),
        ):
            if value is not None:
                body[key] = dict(value)
        return self._model(LoopCreated, "POST", "/v1/loops", body)

    def list_loops(self) -> list[LoopPublic]:
        return self._models(LoopPublic, "/v1/loops")

    def get_loop(self, name: str) -> LoopDetail:
        return self._model(LoopDetail, "GET", f"/v1/loops/{name}")

    def serving_ledger(self, name: str) -> ServingLedgerPublic:
        """Both figures per champion (``GET /v1/loops/{loop}/ledger``)."""
        return self._model(ServingLedgerPublic, "GET", f"/v1/loops/{name}/ledger")

    def patch_loop(
        self, name: str, patch: Mapping[str, Any], *, dry_run: bool = False
    ) -> LoopConfigChange:
        """Change a loop's configuration (a merge patch per policy); see ``PATCH /v1/loops``."""
        params = {"dry_run": "true"} if dry_run else None
        return self._model(LoopConfigChange, "PATCH", f"/v1/loops/{name}", dict(patch), params)

    def config_versions(self, name: str, *, limit: int = 50) -> list[LoopConfigVersionPublic]:
        """The loop's configuration history, newest first."""
        return self._models(
            LoopConfigVersionPublic, f"/v1/loops/{name}/config/versions", {"limit": str(limit)}
        )

    def rotate_secret(
        self, name: str, *, grace_seconds: int = 86400, kind: str = "signing_secret"
    ) -> RotateResult:
        return self._model(
            RotateResult,
            "POST",
            f"/v1/loops/{name}/secrets/rotate",
            {"grace_seconds": grace_seconds, "kind": kind},
        )

    def action(
        self,
        name: str,
        action: str,
        *,
        reason: str | None = None,
        by: str | None = None,
        cycle: int = 0,
    ) -> dict[str, Any]:
        """pause, resume, run-now, approve, reject or rollback (a signal to the loop)."""
        body: dict[str, Any] = {"cycle": cycle}
        if reason:
            body["reason"] = reason
        if by:
            body["by"] = by
        return self._object("POST", f"/v1/loops/{name}/{action}", body)

    def start_loop(self, name: str) -> dict[str, Any]:
        """Start the loop's workflow if it is not running (idempotent)."""
        return self._object("POST", f"/v1/loops/{name}/start")

    def set_champion(
        self, name: str, checkpoint: str, *, reason: str | None = None
    ) -> dict[str, Any]:
        """Register a checkpoint directory as the loop's champion."""
        body = {"checkpoint": checkpoint, **({"reason": reason} if reason else {})}
        return self._object("POST", f"/v1/loops/{name}/champion", body)

    def status(self, name: str) -> dict[str, Any]:
        """The loop's row status and its workflow's live status."""
        return self._object("GET", f"/v1/loops/{name}/status")

    def list_traces(
        self,
        name: str,
        *,
        outcome: str | None = None,
        curation: str | None = None,
        reason: str | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> TracePage:
        """A page of the loop's traces, newest first, with what curation made of each;
        pass the page's ``next_cursor`` as ``cursor`` for the next one."""
        params = {"limit": str(limit)}
        for key, value in (
            ("outcome", outcome),
            ("curation", curation),
            ("reason", reason),
            ("since", since.isoformat() if since else None),
            ("until", until.isoformat() if until else None),
            ("cursor", cursor),
        ):
            if value is not None:
                params[key] = value
        return self._model(TracePage, "GET", f"/v1/loops/{name}/traces", params=params)

    def get_trace(self, name: str, external_id: str) -> TraceDetail:
        """One trace: its curation outcome and reason, the tasks it became, its feedback."""
        path = f"/v1/loops/{name}/traces/{quote(external_id, safe='')}"
        return self._model(TraceDetail, "GET", path)


def sign_and_post_traces(
    base_url: str,
    loop: str,
    signing_secret: str,
    traces: Sequence[Mapping[str, Any]],
    *,
    batch: bool = True,
    http: httpx.Client | None = None,
    timeout_s: float = 30.0,
    retries: int = 3,
) -> list[IngestResult]:
    """Post traces to a loop's webhook, signed with the Standard Webhooks scheme.

    ``batch=True`` sends one request (``{"traces": [...]}``); otherwise one request per trace.
    A 503 (Postgres down, queue full) is retried after its ``Retry-After``; any other error
    raises :class:`ApiRequestError`. Each request gets a fresh ``webhook-id``.
    """
    bodies = [{"traces": list(traces)}] if batch else list(traces)
    owned = http is None
    client = http or httpx.Client(timeout=timeout_s)
    url = f"{base_url.rstrip('/')}/v1/loops/{loop}/traces"
    webhook = Webhook(signing_secret)
    results = []
    try:
        for document in bodies:
            payload = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
            results.append(_post_signed(client, url, webhook, payload, retries))
    finally:
        if owned:
            client.close()
    return results


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.0), 30.0)
    except ValueError:
        return 1.0


def _post_signed(
    client: httpx.Client, url: str, webhook: Webhook, payload: str, retries: int
) -> IngestResult:
    msg_id = f"msg_{uuid.uuid4().hex}"
    attempt = 0
    while True:
        now = int(time.time())
        signature = webhook.sign(msg_id, dt.datetime.fromtimestamp(now, dt.UTC), payload)
        headers = {
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(now),
            "webhook-signature": signature,
        }
        try:
            response = client.post(url, content=payload.encode("utf-8"), headers=headers)
        except httpx.TransportError as exc:
            raise ApiUnreachable(f"cannot reach the Ratchet api at {url}: {exc}") from exc
        if response.status_code == 503 and attempt < retries:
            attempt += 1
            time.sleep(_retry_after(response))
            continue
        _raise_for_error(response)
        return IngestResult.model_validate(response.json())
