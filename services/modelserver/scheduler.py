"""Continuous batching: one running batch per engine, which rows join and leave every step.

One thread owns the model (a CPU has few cores and a GPU one stream; two threads decoding
at once only fight over them). It keeps an :class:`~services.inference.engine.ActiveBatch`
running: before every forward step, rows waiting for the same engine (a base model and all
its adapters decode in one batch) join it, up to ``max_batch_rows``; rows leave the moment
they finish and their requests are answered then. A request that arrives while others
decode starts at the next token instead of after the whole batch, which is where a model
server's cost per request goes down (vLLM schedules the same way; measured in
``benchmarks/serving.py``). Engines whose batches cannot grow decode whole batches.

At most ``max_waiting_rows`` wait (more are refused with :class:`QueueFull`, a 429), and a
row whose client hung up is cancelled (:meth:`BatchScheduler.cancel`): it leaves the queue,
or its batch at the next step, instead of decoding to its budget for nobody.

Rows of another engine (a different full model after a swap) wait until the running batch
drains, and rows of the running engine that arrived after them wait too, so no engine is
starved. When the model falls idle with fewer rows waiting than a full batch, it keeps
collecting while rows keep arriving: it starts once ``max_wait_ms`` pass with no new row,
the batch is full, or ``max_collect_ms`` have passed (a queue delay in the manner of
Triton's), so clients answered together start together.

Every prefill and step is timed and its wall time shared among the versions of its rows
(:func:`services.modelserver.usage.count_busy`, which says how), so a served version's busy
compute-seconds are counted however batches mix versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from services.inference.engine import (
    ActiveBatch,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
)
from services.modelserver.usage import count_busy

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More rows wait than the scheduler holds: the request is refused (429), not queued."""


@dataclass
class _Pending:
    engine: Engine
    row: GenerationRequest
    future: Future[GenerationResult]
    version: str = ""  # the served version its busy time is counted to ("": not counted)


class BatchScheduler:
    """Decodes submitted rows in a continuously refilled batch on one background thread."""

    def __init__(
        self,
        *,
        max_batch_rows: int = 32,
        max_wait_ms: float = 5.0,
        max_collect_ms: float = 50.0,
        max_waiting_rows: int = 256,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError("max_batch_rows must be >= 1")
        if max_waiting_rows < 1:
            raise ValueError("max_waiting_rows must be >= 1")
        if max_wait_ms < 0 or max_collect_ms < 0:
            raise ValueError("max_wait_ms and max_collect_ms must be >= 0")
        self._max_rows = max_batch_rows
        self._max_wait_s = max_wait_ms / 1000.0
        self._max_collect_s = max_collect_ms / 1000.0
        self._max_waiting = max_waiting_rows
        self._queue: deque[_Pending] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ratchet-decode", daemon=True)
        self.batches = 0  # groups of rows prefilled together (a new batch, or rows joining one)
        self.rows = 0  # rows prefilled
        self.steps = 0  # forward steps (each makes one token for every running row)
        self.row_steps = 0  # running rows summed over the steps: / steps = mean batch size
        self.cancelled = 0  # rows dropped because their client hung up
        self.refused = 0  # rows refused because the queue was full

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(30)

    def submit(
        self, engine: Engine, row: GenerationRequest, *, version: str = ""
    ) -> Future[GenerationResult]:
        return self.submit_all(engine, [row], version=version)[0]

    def submit_all(
        self, engine: Engine, rows: list[GenerationRequest], *, version: str = ""
    ) -> list[Future[GenerationResult]]:
        """Queue all of ``rows`` or none: :class:`QueueFull` when they would not fit.
        ``version``: the served version the rows' busy time is counted to."""
        futures: list[Future[GenerationResult]] = [Future() for _ in rows]
        with self._wake:
            if self._stopping:
                raise RuntimeError("the model server is shutting down")
            if len(self._queue) + len(rows) > self._max_waiting:
                self.refused += len(rows)
                raise QueueFull(
                    f"{len(self._queue)} rows are waiting to decode (at most "
                    f"{self._max_waiting}); retry later"
                )
            for row, future in zip(rows, futures, strict=True):
                self._queue.append(_Pending(engine, row, future, version))
            self._wake.notify()
        return futures

    def cancel(self, rows: list[GenerationRequest]) -> None:
        """Stop decoding ``rows`` (their client left): waiting ones leave the queue, running
        ones leave their batch at its next step."""
        ids = {id(row) for row in rows}
        with self._wake:
            dropped = [item for item in self._queue if id(item.row) in ids]
            self._queue = deque(item for item in self._queue if id(item.row) not in ids)
        for item in dropped:
            item.future.cancel()
        for row in rows:
            if not row.cancelled.is_set():
                row.cancelled.set()
                self.cancelled += 1

    def waiting(self) -> int:
        with self._wake:
            return len(self._queue)

    def _run(self) -> None:
        batch: ActiveBatch[_Pending] | None = None
        while True:
            if batch is None or not len(batch):
                group = self._next_batch()
                if group is None:
                    return
                batch = ActiveBatch(group[0].engine)
            else:
                group = self._joiners(batch)
            self._join(batch, group)
            if len(batch) and not self._step(batch):
                batch = None

    def _next_batch(self) -> list[_Pending] | None:
        """Wait for rows (collecting a little while they keep coming): the oldest row's
        engine's rows; None once stopping with nothing left."""
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
            return self._take(self._queue[0].engine, self._max_rows)

    def _joiners(self, batch: ActiveBatch[_Pending]) -> list[_Pending]:
        """Rows that may join the running batch now (without waiting)."""
        with self._wake:
            if not self._queue or not batch.can_join():
                return []
            return self._take(batch.engine, self._max_rows - len(batch))

    def _take(self, engine: Engine, room: int) -> list[_Pending]:
        """Up to ``room`` of ``engine``'s rows, oldest first, none after another engine's."""
        taken: list[_Pending] = []
        kept: deque[_Pending] = deque()
        blocked = False
        for item in self._queue:
            if item.engine is engine and not blocked and len(taken) < room:
                taken.append(item)
            else:
                blocked = blocked or item.engine is not engine
                kept.append(item)
        self._queue = kept
        return taken

    def _join(self, batch: ActiveBatch[_Pending], group: list[_Pending]) -> None:
        live: list[_Pending] = []
        for item in group:
            if item.row.cancelled.is_set():
                item.future.cancel()
                continue
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                batch.budget(item.row)
            except EngineError as exc:
                item.future.set_exception(exc)
                continue
            live.append(item)
        if not live:
            return
        started = time.perf_counter()
        try:
            batch.join([(item.row, item) for item in live])
        except Exception as exc:  # reported to each request; the thread keeps serving
            logger.exception("prefilling %d rows failed", len(live))
            for item in live:
                item.future.set_exception(exc)
            return
        self.batches += 1
        self.rows += len(live)
        _count_prefill(time.perf_counter() - started, live)

    def _step(self, batch: ActiveBatch[_Pending]) -> bool:
        """One forward step; answer the rows that finished. False if the batch failed."""
        running = len(batch)
        versions = [item.version for item in batch.rows()]
        started = time.perf_counter()
        try:
            done = batch.step()
        except Exception as exc:  # reported to each request; the thread keeps serving
            logger.exception("decoding a batch of %d rows failed", running)
            for item in batch.rows():
                item.future.set_exception(exc)
            return False
        self.steps += 1
        self.row_steps += running
        _count_step(time.perf_counter() - started, versions)
        for item, result in done:
            item.future.set_result(result)
        return True


def _count_prefill(seconds: float, rows: list[_Pending]) -> None:
    """A prefill's time, shared in proportion to the prompt tokens each row brought."""
    count_busy(seconds, [(item.version, len(item.row.prompt_ids)) for item in rows])


def _count_step(seconds: float, versions: list[str]) -> None:
    """A forward step's time, shared equally by the rows that ran in it."""
    count_busy(seconds, [(version, 1.0) for version in versions])
