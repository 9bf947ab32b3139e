"""Trace posting clients, sync and async, sharing one retry policy and one result type; they
also post feedback on a trace after the fact (``feedback``)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from ratchet_client._signing import _key, signed_headers

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
DEFAULT_BATCH_SIZE = 500  # the api's RATCHET_INGEST_MAX_BATCH default


class RatchetError(Exception):
    """The api refused a request: its status, error code, message and the fields at fault."""

    def __init__(
        self, status_code: int, code: str, message: str, fields: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.fields = fields or []


class RatchetUnreachable(Exception):
    """The api did not answer, and the retries ran out."""


@dataclass
class IngestResult:
    """The api's answer, added up over the batches of one ``post``."""

    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)

    def add(self, answer: Mapping[str, Any], offset: int) -> None:
        self.accepted += int(answer.get("accepted", 0))
        self.duplicates += int(answer.get("duplicates", 0))
        self.rejected += int(answer.get("rejected", 0))
        for item in answer.get("results", []):
            self.results.append({**item, "index": int(item.get("index", 0)) + offset})

    @property
    def warnings(self) -> list[dict[str, Any]]:
        """Each warning of an accepted trace, with the trace's index and external id: what
        the loop's curation will make of it (``no_tools``: a replay loop rejects it;
        ``unlisted_tool``: a call that cannot be replayed). Empty from an api before them."""
        return [
            {"index": item.get("index"), "external_id": item.get("external_id"), **warning}
            for item in self.results
            for warning in item.get("warnings") or []
        ]


@dataclass(frozen=True)
class FeedbackResult:
    """The api's answer to feedback: ``accepted`` (stored now; the trace goes back to
    curation) or ``duplicate`` (the same feedback was stored before; nothing changed)."""

    id: int
    external_id: str
    status: str


def feedback_body(
    *,
    external_id: str,
    score: float | None,
    label: str | None,
    correction: str | None,
    comment: str | None,
    feedback_id: str | None,
) -> bytes:
    """The JSON body of a feedback post; at least one of score, label and correction. It
    names its trace (``external_id``, as the URL does), so the signature covers which trace
    the feedback is about."""
    if score is None and label is None and correction is None:
        raise ValueError("feedback needs at least one of score, label and correction")
    document = {
        key: value
        for key, value in (
            ("external_id", external_id),
            ("id", feedback_id),
            ("score", score),
            ("label", label),
            ("correction", correction),
            ("comment", comment),
        )
        if value is not None
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def _feedback_result(answer: Mapping[str, Any]) -> FeedbackResult:
    return FeedbackResult(int(answer["id"]), str(answer["external_id"]), str(answer["status"]))


def _error(response: httpx.Response) -> RatchetError:
    try:
        error = response.json()["error"]
        return RatchetError(
            response.status_code, error["code"], error["message"], error.get("fields", [])
        )
    except (ValueError, KeyError, TypeError):
        text = response.text[:500] or response.reason_phrase
        return RatchetError(response.status_code, "http_error", text)


def retry_after_seconds(response: httpx.Response | None, attempt: int, backoff_s: float) -> float:
    """How long to wait before the next attempt: the api's Retry-After, else backoff."""
    header = response.headers.get("retry-after") if response is not None else None
    if header:
        try:
            return max(0.0, float(header))
        except ValueError:
            when = email.utils.parsedate_to_datetime(header)
            if when is not None:
                return max(0.0, when.timestamp() - time.time())
    return backoff_s * (2**attempt)


@dataclass(frozen=True)
class _Options:
    url: str
    secret: str
    batch_size: int
    max_retries: int
    backoff_s: float
    max_retry_after_s: float

    @classmethod
    def build(
        cls,
        base_url: str,
        loop: str,
        signing_secret: str,
        batch_size: int,
        max_retries: int,
        backoff_s: float,
        max_retry_after_s: float,
    ) -> _Options:
        _key(signing_secret)  # a malformed secret fails here, not on the first post
        if not 1 <= batch_size <= 10_000:
            raise ValueError("batch_size must be between 1 and 10000")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        url = f"{base_url.rstrip('/')}/v1/loops/{loop}/traces"
        return cls(url, signing_secret, batch_size, max_retries, backoff_s, max_retry_after_s)

    def feedback_url(self, external_id: str) -> str:
        """``POST /v1/loops/{loop}/traces/{external_id}/feedback`` (the id path-quoted)."""
        return f"{self.url}/{quote(external_id, safe='')}/feedback"

    def batches(self, traces: Sequence[Mapping[str, Any]]) -> list[tuple[int, bytes]]:
        out = []
        for start in range(0, len(traces), self.batch_size):
            document = {"traces": [dict(t) for t in traces[start : start + self.batch_size]]}
            body = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
            out.append((start, body))
        return out

    def wait(self, response: httpx.Response | None, attempt: int) -> float:
        return min(retry_after_seconds(response, attempt, self.backoff_s), self.max_retry_after_s)

    def answer(
        self,
        response: httpx.Response | None,
        failure: httpx.TransportError | None,
        attempt: int,
    ) -> dict[str, Any] | None:
        """The api's answer to an attempt, or None to retry; raises once retrying cannot help.

        Shared by the sync and async clients so that both give up on the same answers.
        """
        if response is None:
            if attempt >= self.max_retries:
                raise RatchetUnreachable(f"cannot reach {self.url}: {failure}") from failure
            return None
        if response.is_success:
            answer: dict[str, Any] = response.json()
            return answer
        if response.status_code not in RETRYABLE_STATUS or attempt >= self.max_retries:
            raise _error(response)
        return None


_HTTP = TypeVar("_HTTP", httpx.Client, httpx.AsyncClient)


class _BufferedClient(Generic[_HTTP]):
    """The options, http client and buffer that the sync and async clients hold alike."""

    _http_class: type[_HTTP]

    def __init__(
        self,
        base_url: str,
        loop: str,
        signing_secret: str,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_retry_after_s: float = 60.0,
        timeout_s: float = 30.0,
        http: _HTTP | None = None,
    ) -> None:
        self._options = _Options.build(
            base_url, loop, signing_secret, batch_size, max_retries, backoff_s, max_retry_after_s
        )
        self._owned = http is None
        self._http: _HTTP = http or self._http_class(timeout=timeout_s)
        self._buffer: list[Mapping[str, Any]] = []

    def _buffer_is_full(self, trace: Mapping[str, Any]) -> bool:
        self._buffer.append(trace)
        return len(self._buffer) >= self._options.batch_size

    def _take_buffer(self) -> list[Mapping[str, Any]]:
        pending, self._buffer = self._buffer, []
        return pending


class TraceClient(_BufferedClient[httpx.Client]):
    """Posts signed traces to one loop's webhook. Use as a context manager (flushes on exit).

    ``post`` sends now (one request per ``batch_size`` traces); ``add`` buffers and sends
    whenever ``batch_size`` traces are waiting, and ``flush`` sends the rest.
    """

    _http_class = httpx.Client

    def __enter__(self) -> TraceClient:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.close()

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def post(self, traces: Iterable[Mapping[str, Any]]) -> IngestResult:
        """Send ``traces`` now, in batches; the result adds the batches' answers up."""
        result = IngestResult()
        for offset, body in self._options.batches(list(traces)):
            result.add(self._send(self._options.url, body), offset)
        return result

    def add(self, trace: Mapping[str, Any]) -> IngestResult | None:
        """Buffer one trace; sends the buffer (and returns its result) once it is full."""
        return self.flush() if self._buffer_is_full(trace) else None

    def feedback(
        self,
        external_id: str,
        *,
        score: float | None = None,
        label: str | None = None,
        correction: str | None = None,
        comment: str | None = None,
        feedback_id: str | None = None,
    ) -> FeedbackResult:
        """Feedback on a posted trace, after the fact: a score, a label, a correction (what
        the answer should have been), a comment. Posting the same feedback again (or the
        same ``feedback_id``) is a no-op; an unknown trace raises RatchetError (404). Traces
        buffered by ``add`` are sent first, so feedback never races its own trace."""
        body = feedback_body(
            external_id=external_id,
            score=score,
            label=label,
            correction=correction,
            comment=comment,
            feedback_id=feedback_id,
        )
        self.flush()
        return _feedback_result(self._send(self._options.feedback_url(external_id), body))

    def flush(self) -> IngestResult:
        """Send whatever is buffered (nothing to send: an empty result)."""
        pending = self._take_buffer()
        return self.post(pending) if pending else IngestResult()

    def _send(self, url: str, body: bytes) -> dict[str, Any]:
        msg_id = f"msg_{uuid.uuid4().hex}"
        attempt = 0
        while True:
            response: httpx.Response | None = None
            failure: httpx.TransportError | None = None
            headers = signed_headers(self._options.secret, body, msg_id=msg_id)
            try:
                response = self._http.post(url, content=body, headers=headers)
            except httpx.TransportError as exc:
                failure = exc
            answer = self._options.answer(response, failure, attempt)
            if answer is not None:
                return answer
            time.sleep(self._options.wait(response, attempt))
            attempt += 1


class AsyncTraceClient(_BufferedClient[httpx.AsyncClient]):
    """:class:`TraceClient` for asyncio code (same batching, retries and results)."""

    _http_class = httpx.AsyncClient

    async def __aenter__(self) -> AsyncTraceClient:
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                await self.flush()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def post(self, traces: Iterable[Mapping[str, Any]]) -> IngestResult:
        result = IngestResult()
        for offset, body in self._options.batches(list(traces)):
            result.add(await self._send(self._options.url, body), offset)
        return result

    async def add(self, trace: Mapping[str, Any]) -> IngestResult | None:
        return await self.flush() if self._buffer_is_full(trace) else None

    async def feedback(
        self,
        external_id: str,
        *,
        score: float | None = None,
        label: str | None = None,
        correction: str | None = None,
        comment: str | None = None,
        feedback_id: str | None = None,
    ) -> FeedbackResult:
        """:meth:`TraceClient.feedback`."""
        body = feedback_body(
            external_id=external_id,
            score=score,
            label=label,
            correction=correction,
            comment=comment,
            feedback_id=feedback_id,
        )
        await self.flush()
        return _feedback_result(await self._send(self._options.feedback_url(external_id), body))

    async def flush(self) -> IngestResult:
        pending = self._take_buffer()
        return await self.post(pending) if pending else IngestResult()

    async def _send(self, url: str, body: bytes) -> dict[str, Any]:
        msg_id = f"msg_{uuid.uuid4().hex}"
        attempt = 0
        while True:
            response: httpx.Response | None = None
            failure: httpx.TransportError | None = None
            headers = signed_headers(self._options.secret, body, msg_id=msg_id)
            try:
                response = await self._http.post(url, content=body, headers=headers)
            except httpx.TransportError as exc:
                failure = exc
            answer = self._options.answer(response, failure, attempt)
            if answer is not None:
                return answer
            await asyncio.sleep(self._options.wait(response, attempt))
            attempt += 1
