"""Every retry policy and activity timeout the workflows use, defined once.

A workflow picks a preset by what its activity does (a short database transaction, a job, a
deploy, a curation batch, a purge), so the same kind of call retries the same way in every
workflow. Retry policies and timeouts are not part of a history's determinism check, so a
preset can be tuned without breaking running workflows; the architecture test allows
``RetryPolicy(...)`` nowhere else under ``workflows/``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, overload

from temporalio import workflow
from temporalio.common import RetryPolicy

ArgT = TypeVar("ArgT")
ResultT = TypeVar("ResultT")

# Database transactions --------------------------------------------------------------------

# One small transaction (a lookup, a row written): a minute is ample even on a busy database.
SHORT_TIMEOUT = timedelta(seconds=60)
# A transaction that reads or writes a whole split (a snapshot, a task export, a rollback).
LONG_DB_TIMEOUT = timedelta(minutes=10)
# Reading a job's per-task results file and storing them: seconds for any set a job may
# write. No heartbeat, so this is also how long a cycle waits to retry the activity when
# the worker running it dies (kill -9, an OOM kill): it was 5 minutes, and the chaos test
# caught a cycle stalled in evaluate for that long after a kill landed mid-record.
RESULTS_TIMEOUT = timedelta(minutes=2)
# Activities raise errors no retry can fix as non-retryable; the rest (a database restart,
# a lost connection) are retried until the database is back.
DB_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)
)
# The canary's bookkeeping: retried like DB_RETRY, but a promotion that cannot record its
# status after ten attempts fails instead of holding a half-deployed model forever.
BOUNDED_DB_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=10,
)


async def db_activity(
    activity: Callable[[Any, ArgT], ResultT],
    arg: ArgT,
    *,
    start_to_close: timedelta = SHORT_TIMEOUT,
    retry: RetryPolicy = DB_RETRY,
) -> ResultT:
    """Workflow code: run an activity that is one database transaction, as most calls are.

    The activity is passed by reference (``GateActivities.gate``), so the type checker sees
    its input and result; the timeout and retry are this module's database presets.
    """
    return await workflow.execute_activity_method(
        activity, arg, start_to_close_timeout=start_to_close, retry_policy=retry
    )


# Long activities --------------------------------------------------------------------------


@dataclass(frozen=True)
class LongActivity:
    """The bounds of an activity that runs for minutes or hours and heartbeats meanwhile: how
    long it may take, how soon a silent worker counts as dead, and how it retries."""

    timeout: timedelta
    heartbeat: timedelta
    retry: RetryPolicy


@overload
async def long_activity(
    activity: Callable[[Any, ArgT], Awaitable[ResultT]], arg: ArgT, preset: LongActivity
) -> ResultT: ...


@overload
async def long_activity(
    activity: Callable[[Any, ArgT], ResultT], arg: ArgT, preset: LongActivity
) -> ResultT: ...


async def long_activity(
    activity: Callable[[Any, ArgT], Any], arg: ArgT, preset: LongActivity
) -> Any:
    """Workflow code: run a heartbeating activity (an install, a deploy, a curation batch, a
    purge) under one of this module's presets, async (``JobActivities``) or not."""
    return await workflow.execute_activity_method(
        activity,
        arg,
        start_to_close_timeout=preset.timeout,
        heartbeat_timeout=preset.heartbeat,
        retry_policy=preset.retry,
    )


# Jobs -------------------------------------------------------------------------------------

# A job's bound: eval and probe jobs always, training when its profile names no ``timeout_s``.
JOB_TIMEOUT = timedelta(hours=6)
# Job runs adopt the job an earlier attempt started, so a retry never starts a second one.
JOB_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2),
    maximum_interval=timedelta(minutes=1),
    maximum_attempts=5,
)
# The job activity heartbeats while it follows the job, so a dead worker is noticed soon.
JOB = LongActivity(timeout=JOB_TIMEOUT, heartbeat=timedelta(seconds=60), retry=JOB_RETRY)

# Checkpoints and serving ------------------------------------------------------------------

# Installing a checkpoint (copy + hash) or deploying one (a rollout, a model load); both
# heartbeat while they copy or wait.
_INSTALL_TIMEOUT = timedelta(minutes=30)
_INSTALL_HEARTBEAT = timedelta(minutes=2)
# An install is retried like the job that wrote the checkpoint.
INSTALL = LongActivity(timeout=_INSTALL_TIMEOUT, heartbeat=_INSTALL_HEARTBEAT, retry=JOB_RETRY)
# A deploy that fails three times is a failed promotion; the previous champion is restored.
DEPLOY = LongActivity(
    timeout=_INSTALL_TIMEOUT,
    heartbeat=_INSTALL_HEARTBEAT,
    retry=RetryPolicy(
        initial_interval=timedelta(seconds=2),
        maximum_interval=timedelta(seconds=30),
        maximum_attempts=3,
    ),
)

# Curation ---------------------------------------------------------------------------------

# A batch is one transaction of a few seconds that heartbeats between its steps, so a worker
# that died mid-batch is noticed within the heartbeat timeout and the batch retried elsewhere.
CURATE_BATCH = LongActivity(
    timeout=timedelta(minutes=10),
    heartbeat=timedelta(seconds=10),
    retry=RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(minutes=1),
        non_retryable_error_types=[
            "InvalidInput",
            "InvalidPolicy",
            "NotFound",
            "UnknownEnvironment",
        ],
    ),
)

# Retention --------------------------------------------------------------------------------

# One purge walks every expired body in batches, heartbeating between them.
PURGE = LongActivity(
    timeout=timedelta(hours=1),
    heartbeat=timedelta(minutes=2),
    retry=RetryPolicy(
        initial_interval=timedelta(seconds=5),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(minutes=5),
        maximum_attempts=10,
    ),
)

# Serving ledger ---------------------------------------------------------------------------

# One sample reads each serving loop's /metrics (an endpoint's own timeout bounds each read)
# and heartbeats between loops; a sample that fails is the next one's to make up: the
# counters are cumulative, so nothing is lost by skipping one.
LEDGER_SAMPLE = LongActivity(
    timeout=timedelta(minutes=10),
    heartbeat=timedelta(minutes=2),
    retry=RetryPolicy(initial_interval=timedelta(seconds=5), maximum_attempts=3),
)
