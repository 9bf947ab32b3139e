"""Waking an idle loop when its traffic resumes: the first accepted trace after a quiet spell
signals the loop's workflow (``LoopWorkflow.wake``).

A LoopWorkflow with nothing to do backs its trigger checks off, up to the trigger policy's
``idle_check_interval_s`` (workflows/trigger.py), so that a loop without traffic costs next to
nothing; this is what keeps new traffic from waiting out that backoff. It signals at most
once per quiet spell (``quiet_s`` without an accepted trace of that loop in this process):
under steady traffic the loop checks at its own ``check_interval_s`` and no signal is sent
(each one is a Temporal action), and after a pause the first trace wakes the loop.

The signal goes out in the background, after the traces are committed: ingest never waits on
Temporal, and a signal that fails (Temporal down, the loop's workflow not running) is logged
and dropped, as the loop's next check finds the traces anyway. What it remembers is one
timestamp per loop that posted (bounded by the loops that exist: only authenticated posts
get here), and it forgets loops quiet for longer than ``quiet_s`` once it holds many.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from temporalio.client import Client

from workflows.ids import loop_workflow_id
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import WakeSignal

logger = logging.getLogger(__name__)

# A loop with no accepted trace for this long counts as quiet: its next trace wakes it. Under
# the default check_interval_s (30 s) a loop that got traffic within this window has not
# backed off past two intervals, so a signal would save it little.
WAKE_AFTER_QUIET_S = 60.0
# Past this many remembered loops, those quiet for longer than quiet_s are forgotten.
_PRUNE_AT = 4096


class LoopWaker:
    """Signals ``wake`` to a loop on its first accepted trace after ``quiet_s`` of silence
    (and on a configuration change). Made on the event loop it signals from."""

    def __init__(
        self,
        send: Callable[[str], Awaitable[None]],
        *,
        quiet_s: float = WAKE_AFTER_QUIET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._quiet_s = quiet_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._event_loop = asyncio.get_running_loop()
        self.sent = 0  # signals sent (for tests and /metrics readers)

    def traces_arrived(self, loop: str) -> None:
        """Called after traces of ``loop`` were committed; never blocks, never raises."""
        now = self._clock()
        last = self._last.get(loop)
        self._last[loop] = now
        if last is not None and now - last < self._quiet_s:
            return
        if len(self._last) > _PRUNE_AT:
            self._prune(now)
        self._spawn(loop)

    def wake(self, loop: str) -> None:
        """Signal ``wake`` now, quiet or not (the loop's configuration changed, so its next
        check should not wait out a backoff); callable from any thread, never blocks."""
        self._event_loop.call_soon_threadsafe(self._spawn, loop)

    def _spawn(self, loop: str) -> None:
        task = self._event_loop.create_task(self._wake(loop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Drop the signals still in flight (shutdown): each is only an early wake-up."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _wake(self, loop: str) -> None:
        try:
            await self._send(loop)
        except Exception as exc:  # the next check finds the traces anyway
            logger.info("could not wake loop %s (%s); its next trigger check finds them", loop, exc)
            return
        self.sent += 1

    def _prune(self, now: float) -> None:
        self._last = {loop: seen for loop, seen in self._last.items() if now - seen < self._quiet_s}


def temporal_waker(
    connect: Callable[[], Awaitable[Client]], *, quiet_s: float = WAKE_AFTER_QUIET_S
) -> LoopWaker:
    """The api's waker: signals through the client ``connect`` gives (the api's lazily
    connected one, ``AppState.temporal.get``)."""

    async def send(loop: str) -> None:
        client = await connect()
        handle = client.get_workflow_handle(loop_workflow_id(loop))
        await handle.signal(LoopWorkflow.wake, WakeSignal())

    return LoopWaker(send, quiet_s=quiet_s)
