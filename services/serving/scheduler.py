"""Dynamic batching: the requests waiting when the model is free are decoded together.

One thread owns the model (a CPU has few cores and a GPU one stream; two threads decoding
at once only fight over them). It takes the oldest waiting row, every other waiting row of
the same engine (a base model and all its adapters decode in one batch), up to
``max_batch_rows``, and decodes them with :func:`services.serving.engine.decode_batch`:
one forward pass per new token for the whole batch, with a key/value cache. Rows that
arrive meanwhile wait for the next batch — a few tokens' latency for a request, in
exchange for the throughput of a batch, which is where a model server's cost per request
goes down (measured in ``benchmarks/serving.py``).

When the model falls idle with fewer rows waiting than a full batch, it keeps collecting
while rows keep arriving: it starts once ``max_wait_ms`` pass with no new row, the batch is
full, or ``max_collect_ms`` have passed (a queue delay in the manner of Triton's). Clients
whose answers just came back send their next requests within a few milliseconds of each
other; without the wait every batch after the first would start with whoever happened to
be back first, and the rest would wait a whole batch for the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from services.serving.engine import Engine, GenerationRequest, GenerationResult, decode_batch

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    engine: Engine
    row: GenerationRequest
    future: Future[GenerationResult]


class BatchScheduler:
    """Decodes submitted rows in batches on one background thread."""

    def __init__(
        self,
        *,
        max_batch_rows: int = 32,
        max_wait_ms: float = 5.0,
        max_collect_ms: float = 50.0,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError("max_batch_rows must be >= 1")
        if max_wait_ms < 0 or max_collect_ms < 0:
            raise ValueError("max_wait_ms and max_collect_ms must be >= 0")
        self._max_rows = max_batch_rows
        self._max_wait_s = max_wait_ms / 1000.0
        self._max_collect_s = max_collect_ms / 1000.0
        self._queue: deque[_Pending] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ratchet-decode", daemon=True)
        self.batches = 0
        self.rows = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(30)

    def submit(self, engine: Engine, row: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the model server is shutting down")
            self._queue.append(_Pending(engine, row, future))
            self._wake.notify()
        return future

    def waiting(self) -> int:
        with self._wake:
            return len(self._queue)

    def _next_batch(self) -> list[_Pending] | None:
        with self._wake:
            while not self._queue and not self._stopping:
                self._wake.wait()
            if self._stopping and not self._queue:
                return None
            cap = time.monotonic() + self._max_collect_s
            while len(self._queue) < self._max_rows and not self._stopping:
                waiting = len(self._queue)
                remaining = min(self._max_wait_s, cap - time.monotonic())
                if remaining <= 0:
                    break
                self._wake.wait(remaining)
                if len(self._queue) == waiting:
                    break  # nothing new within max_wait: start
            engine = self._queue[0].engine
            batch: list[_Pending] = []
            kept: deque[_Pending] = deque()
            while self._queue:
                item = self._queue.popleft()
                if item.engine is engine and len(batch) < self._max_rows:
                    batch.append(item)
                else:
                    kept.append(item)
            self._queue = kept
            return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            live = [item for item in batch if item.future.set_running_or_notify_cancel()]
            if not live:
                continue
            engine = live[0].engine
            try:
                results = decode_batch(engine, [item.row for item in live], engine.device)
            except Exception as exc:  # reported to each request; the thread keeps serving
                logger.exception("decoding a batch of %d rows failed", len(live))
                for item in live:
                    item.future.set_exception(exc)
                continue
            self.batches += 1
            self.rows += len(live)
            for item, result in zip(live, results, strict=True):
                item.future.set_result(result)
