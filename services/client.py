"""A small typed client of Ratchet's admin API: loops, their traces, tasks and datasets.

Every ``ratchet`` command that reads or changes a running Ratchet goes through it (see
services.cli). Posting traces is the agent's side and has its own client, ``clients/python``
(``ratchet_client``), which ``ratchet demo``'s simulated traffic uses too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from services.api.schemas.ledger import ServingLedgerPublic
from services.api.schemas.loops import (
    LoopConfigChange,
    LoopConfigVersionPublic,
    LoopCreateCheck,
    LoopCreated,
    LoopDetail,
    LoopPublic,
    LoopToolsPublic,
    RotateResult,
)
from services.api.schemas.tasks import (
    DatasetDetail,
    DatasetPage,
    PinResult,
    RestoreResult,
    TaskDetail,
    TaskPage,
)
from services.api.schemas.traces import TraceDetail, TracePage

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


@dataclass(frozen=True)
class LoopPolicies:
    """A new loop's policy documents, as ``POST /v1/loops`` takes them: each one left None
    gets the server's defaults (``services.loop.policies``)."""

    training_profile: Mapping[str, Any] | None = None
    serving_target: Mapping[str, Any] | None = None
    gate_policy: Mapping[str, Any] | None = None
    trigger_policy: Mapping[str, Any] | None = None
    curation_policy: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> LoopPolicies:
        """The policies a configuration document names (a loop file's keys); its other
        keys (environment, executor, budget) are not policies and are left out."""
        return cls(**{f.name: document.get(f.name) for f in fields(cls)})

    def documents(self) -> dict[str, dict[str, Any]]:
        """The policies set, by their key in the request body."""
        named = ((f.name, getattr(self, f.name)) for f in fields(self))
        return {key: dict(value) for key, value in named if value is not None}


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
        policies: LoopPolicies = LoopPolicies(),
        changed_by: str | None = None,
    ) -> LoopCreated:
        """Create a loop; the answer holds its signing secret and ingest token (shown once)."""
        body = _create_body(name, environment, executor, budget_usd, policies, changed_by)
        return self._model(LoopCreated, "POST", "/v1/loops", body)

    def check_new_loop(
        self,
        name: str,
        environment: str,
        *,
        executor: str | None = "local",
        budget_usd: Decimal | float | None = None,
        policies: LoopPolicies = LoopPolicies(),
    ) -> LoopCreateCheck:
        """Every check creating this loop would make (a 422 naming the field, a 409 for a
        taken name), creating nothing: ``ratchet loop apply --dry-run``."""
        body = _create_body(name, environment, executor, budget_usd, policies, None)
        return self._model(LoopCreateCheck, "POST", "/v1/loops", body, {"dry_run": "true"})

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

    def bootstrap(
        self,
        name: str,
        *,
        base: str | None = None,
        force: bool = False,
        dry_run: bool = False,
        reason: str | None = None,
        by: str | None = None,
    ) -> dict[str, Any]:
        """Bootstrap a first champion from the loop's successful traces: what it will learn
        from (or, with ``dry_run``, would), and the loop's workflow signalled."""
        body: dict[str, Any] = {"force": force, "dry_run": dry_run}
        for key, value in (("base", base), ("reason", reason), ("by", by)):
            if value:
                body[key] = value
        return self._object("POST", f"/v1/loops/{name}/bootstrap", body)

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
        params = _params(
            limit=str(limit),
            outcome=outcome,
            curation=curation,
            reason=reason,
            since=since.isoformat() if since else None,
            until=until.isoformat() if until else None,
            cursor=cursor,
        )
        return self._model(TracePage, "GET", f"/v1/loops/{name}/traces", params=params)

    def get_trace(self, name: str, external_id: str) -> TraceDetail:
        """One trace: its curation outcome and reason, the tasks it became, its feedback."""
        path = f"/v1/loops/{name}/traces/{quote(external_id, safe='')}"
        return self._model(TraceDetail, "GET", path)

    def list_tasks(
        self,
        name: str,
        *,
        split: str | None = None,
        set_aside: bool | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> TaskPage:
        """A page of the loop's curated tasks, newest first; pass the page's
        ``next_cursor`` as ``cursor`` for the next one."""
        aside = None if set_aside is None else str(set_aside).lower()
        params = _params(limit=str(limit), split=split, set_aside=aside, cursor=cursor)
        return self._model(TaskPage, "GET", f"/v1/loops/{name}/tasks", params=params)

    def get_task(self, task_id: int) -> TaskDetail:
        """One task by its row id: spec, split, redactions, the traces it came from."""
        return self._model(TaskDetail, "GET", f"/v1/tasks/{task_id}")

    def pin_tasks(self, name: str, task_ids: Sequence[int]) -> PinResult:
        """Put tasks into the loop's pinned regression suite: all of them, or none."""
        body = {"task_ids": list(task_ids)}
        return self._model(PinResult, "POST", f"/v1/loops/{name}/tasks/pin", body)

    def restore_tasks(self, name: str, task_ids: Sequence[int]) -> RestoreResult:
        """Bring set-aside tasks back (all of them, or none when one is not the loop's)."""
        body = {"task_ids": list(task_ids)}
        return self._model(RestoreResult, "POST", f"/v1/loops/{name}/tasks/restore", body)

    def loop_tools(self, name: str) -> LoopToolsPublic:
        """The loop's live tool endpoint: its allow-list and the server's listing."""
        return self._model(LoopToolsPublic, "GET", f"/v1/loops/{name}/tools")

    def list_datasets(
        self, name: str, *, cursor: str | None = None, limit: int = 50
    ) -> DatasetPage:
        """A page of the loop's dataset snapshots, newest first."""
        params = _params(limit=str(limit), cursor=cursor)
        return self._model(DatasetPage, "GET", f"/v1/loops/{name}/datasets", params=params)

    def get_dataset(self, dataset_id: int) -> DatasetDetail:
        """One dataset by its row id: counts, files, statistics, source trace count."""
        return self._model(DatasetDetail, "GET", f"/v1/datasets/{dataset_id}")


def _create_body(
    name: str,
    environment: str,
    executor: str | None,
    budget_usd: Decimal | float | None,
    policies: LoopPolicies,
    changed_by: str | None,
) -> dict[str, Any]:
    """``POST /v1/loops``'s body: what is set, the server's defaults for the rest."""
    body: dict[str, Any] = {"name": name, "environment": environment}
    if executor is not None:  # None: the server's RATCHET_EXECUTOR
        body["executor"] = executor
    if changed_by:
        body["changed_by"] = changed_by
    if budget_usd is not None:
        body["budget_usd"] = str(budget_usd)
    body.update(policies.documents())
    return body


def _params(**values: str | None) -> dict[str, str]:
    """The query parameters that were given (None: left out)."""
    return {key: value for key, value in values.items() if value is not None}
