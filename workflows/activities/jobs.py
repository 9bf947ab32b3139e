"""Activities that run jobs on executors and register the checkpoints they produce.

``run_job`` takes a job from nothing to a finished ``runs`` row:

1. upsert the run (``pending``); a run that already ended returns its recorded result;
2. submit the job, or adopt the one already running: the handle comes from the last
   heartbeat (a retry after a worker restart), else from the run row, else the executor
   submits — and executors adopt by run id too, so a run id never makes two jobs;
3. wait for it, heartbeating the handle after every wait, so the next attempt resumes;
4. read ``metrics.json``, account compute and cost at the configured prices
   (``services.executors.accounting``), and write the outcome.

It is idempotent (steps 1 and 2 adopt, step 4 writes absolute values once). A failed,
lost or cancelled job is a result (``RunJobResult.status``), for the workflow to decide;
errors are raised on purpose: a bad job request or template, an unknown loop, or a job
exiting with a config exit code are non-retryable ``ApplicationError``s; an unreachable API
server is retryable. A cancel requested by the workflow cancels the job; a worker shutting down
or a heartbeat timeout does not (the next attempt adopts the job).

``cancel_job`` stops a run's job and marks it cancelled. ``register_checkpoint`` verifies
a job's checkpoint directory against its manifest, copies it into the content-addressed
store (``checkpoints/<id>``) and upserts the ``checkpoints`` row with its parent and the
run that produced it (``services.checkpoints``); this module only turns what those refuse
into non-retryable ``ApplicationError``s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.exceptions import ApplicationError

from services.artifacts import ArtifactStore, path_to_uri, uri_to_path
from services.checkpoints import (
    CheckpointRefused,
    InstalledCheckpoint,
    install_checkpoint,
    register_run_checkpoint,
    resolve_parent,
)
from services.curation import demonstrations
from services.curation.job_outputs import record_job_outputs
from services.db.queries import runs as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.executors.accounting import (
    FinishedJob,
    job_cost,
    judge_cost_usd,
    observe_finished_job,
)
from services.executors.base import (
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    Handle,
    JobRequest,
    JobRequestError,
    JobStatus,
)
from services.executors.runfiles import UnsafeRunFile, create_exclusive
from services.logs import log_context
from services.loop.job_documents import (
    job_document,
    job_environment,
    job_files,
    job_nodes,
    replay_dataset,
)
from services.loop.states import RunStatus
from services.settings import Settings
from workflows.activities import finished_outputs
from workflows.activities.errors import fails_as
from workflows.activities.job_results import (
    datetime_of,
    error_of,
    past_deadline,
    result_details,
    result_of,
)
from workflows.options import JOB
from workflows.payloads.jobs import (
    CancelJobInput,
    RegisterCheckpointInput,
    RegisterCheckpointResult,
    RunJobInput,
    RunJobResult,
)

logger = logging.getLogger(__name__)

ExecutorFactory = Callable[[str], Executor]
# How much longer than its job's deadline one attempt may last: time to stop the job and
# record its run before Temporal times the attempt out.
DEADLINE_GRACE = timedelta(minutes=5)
LOG_FILE = "job.log"
OUTPUT_SUBDIR = "output"
# The names of the threads that wait on jobs (JobActivities' own pool).
FOLLOW_THREAD_PREFIX = "ratchet-job-follow"


@dataclass(frozen=True)
class _Prepared:
    """What step 1 learned: the run as stored and the job to submit for it."""

    executor: str
    handle: Handle | None
    spec: JobRequest | None
    result: RunJobResult | None
    started_at: dt.datetime | None = None


class JobActivities:
    """Job activities; dependencies come in, nothing is built here."""

    def __init__(
        self,
        *,
        session_factory: SessionFactory,
        executors: ExecutorFactory | Mapping[str, Executor],
        artifacts: ArtifactStore,
        settings: Settings,
        max_poll_failures: int = 8,
        follow_threads: int = 64,
    ) -> None:
        """``executors`` maps an executor name (a loop's ``executor``) to an executor.

        ``max_poll_failures`` consecutive status failures (with backoff) end the attempt with
        a retryable error; the next attempt adopts the job from the heartbeat.

        ``follow_threads``: the threads that wait on jobs (``Executor.wait`` blocks until the
        job's state changes or the poll interval passes). They are this class's own, made
        as needed: followers waiting in the event loop's shared pool (a few threads) would
        queue behind each other, heartbeat late, and hold up every other activity's
        ``to_thread`` call (a deploy, a checkpoint's registration) meanwhile.
        """
        self._max_poll_failures = max_poll_failures
        self._follow_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=follow_threads, thread_name_prefix=FOLLOW_THREAD_PREFIX
        )
        self._sessions = session_factory
        self._artifacts = artifacts
        self._settings = settings
        self._executor_factory = executors
        self._executor_cache: dict[str, Executor] = {}

    def activities(self) -> list[Callable[..., Any]]:
        return [self.run_job, self.cancel_job, self.register_checkpoint]

    # run_job -----------------------------------------------------------------------------

    @activity.defn(name="run_job")
    async def run_job(self, input: RunJobInput) -> RunJobResult:
        """Run one job to its end: submit or adopt, wait with heartbeats, account, record.

        Idempotent: the same run id never makes two jobs, and a finished run returns what
        was recorded.
        """
        with log_context(loop=input.loop, cycle=input.cycle, run=input.run_id):
            try:
                return await self._run_job(input)
            except ExecutorError as exc:
                raise _application_error(exc) from exc

    async def _run_job(self, input: RunJobInput) -> RunJobResult:
        prepared = await asyncio.to_thread(self._prepare, input)
        if prepared.result is not None:
            return prepared.result
        handle = _heartbeat_handle() or prepared.handle
        executor_name = (
            str(handle.get("executor", prepared.executor)) if handle else prepared.executor
        )
        executor = self._executor(executor_name)
        # A job still waiting for a slot is submitted again: the executor adopts it, and the
        # process that follows it holds its request to start it (a restarted worker too).
        if handle is None or handle.get("queued"):
            assert prepared.spec is not None
            try:
                handle = await asyncio.to_thread(executor.submit, prepared.spec)
            except JobRequestError as exc:  # the executor refused the job (e.g. a loop command)
                await asyncio.to_thread(self._fail_before_submit, input.run_id, str(exc))
                raise
            cancelled = await asyncio.to_thread(self._record_handle, input.run_id, handle)
            if cancelled:  # cancel_job ran while we were submitting
                await asyncio.to_thread(executor.cancel, handle)
        activity.heartbeat({"handle": handle})
        status = await self._follow(input, executor, handle, prepared.started_at)
        return await asyncio.to_thread(self._finish, input, executor_name, handle, status)

    def _prepare(self, input: RunJobInput) -> _Prepared:
        run_dir = self._artifacts.run_dir(input.loop, input.run_id)
        output_dir = run_dir / OUTPUT_SUBDIR
        logs_dir = self._artifacts.logs_dir(input.loop, input.run_id)
        with self._sessions.begin() as session:
            try:
                loop = require_loop(session=session, name=input.loop)
            except NotFound as exc:
                raise ApplicationError(str(exc), type="UnknownLoop", non_retryable=True) from None
            cycle_id = q.cycle_id_for(session=session, loop_id=loop.id, number=input.cycle)
            submitted = q.NewRun(
                run_id=input.run_id,
                loop_id=loop.id,
                kind=input.kind,
                executor=q.cycle_executor(session=session, loop=loop, cycle_id=cycle_id),
                spec=input.job_spec,
                cycle_id=cycle_id,
                dataset_id=input.dataset_id,
                base_checkpoint_id=input.base_checkpoint_id,
                accelerators=input.accelerators,
                artifacts=q.RunArtifacts(
                    output_uri=path_to_uri(output_dir), logs_uri=path_to_uri(logs_dir / LOG_FILE)
                ),
            )
            run = q.upsert_run(session=session, run=submitted)
            if RunStatus(run.status).terminal:
                return _Prepared(run.executor, run.handle, None, result_of(run))
            executor, handle, started_at = run.executor, run.handle, run.started_at
            dataset, base = job_files(
                session=session,
                kind=input.kind,
                job_spec=input.job_spec,
                dataset_id=input.dataset_id,
                base_checkpoint_id=input.base_checkpoint_id,
            )
            curation_policy = dict(loop.curation_policy or {})
            kept = demonstrations.job_spec_keys(
                session,
                kind=input.kind,
                run_dir=run_dir,
                loop_id=loop.id,
                dataset_id=input.dataset_id,
                per_task=self._settings.demonstrations_per_task,
            )
            replay = replay_dataset(
                session=session, kind=input.kind, run_dir=run_dir, dataset_id=input.dataset_id
            )
        try:
            environment = job_environment(curation_policy, self._settings, run_dir)
            spec = JobRequest(
                run_id=input.run_id,
                loop=input.loop,
                kind=input.kind,
                document={**replay, **job_document(input.job_spec, input.run_id), **kept},
                run_dir=run_dir,
                output_dir=output_dir,
                logs_dir=logs_dir,
                cycle=input.cycle,
                dataset=dataset,
                base_checkpoint=base,
                accelerators=input.accelerators,
                nodes=job_nodes(input.job_spec),
                image=input.job_image,
                command=tuple(input.job_command) if input.job_command else None,
                env=environment.plain,
                secret_env=environment.credentials,
            )
        except JobRequestError as exc:
            self._fail_before_submit(input.run_id, str(exc))
            raise
        return _Prepared(executor, handle, spec, None, started_at)

    def _fail_before_submit(self, run_id: str, error: str) -> None:
        """A run whose job cannot even be described ends as failed, with the reason."""
        with self._sessions.begin() as session:
            outcome = q.RunOutcome(
                status=RunStatus.FAILED, error=error, ended_at=dt.datetime.now(dt.UTC)
            )
            q.finish_run(session=session, run_id=run_id, outcome=outcome)

    def _record_handle(self, run_id: str, handle: Handle) -> bool:
        """Store the handle; True when the run was cancelled meanwhile."""
        with self._sessions.begin() as session:
            q.record_submission(session=session, run_id=run_id, handle=handle)
            run = q.get_run(session=session, run_id=run_id)
            return run is not None and run.status == RunStatus.CANCELLED

    async def _follow(
        self,
        input: RunJobInput,
        executor: Executor,
        handle: Handle,
        started_at: dt.datetime | None,
    ) -> JobStatus:
        """Wait for the job's end, heartbeating; a requested cancel cancels the job, and a
        job running past ``input.deadline_s`` from its first start is stopped."""
        marked_running = False
        failures = 0
        try:
            while True:
                try:
                    status = await asyncio.get_running_loop().run_in_executor(
                        self._follow_pool, executor.wait, handle, max(0.1, input.poll_interval_s)
                    )
                except ExecutorUnavailable as exc:
                    # A blip of the API server should not cost a long job its attempt: keep
                    # heartbeating and ask again, and give up only when it lasts.
                    failures += 1
                    activity.heartbeat({"handle": handle, "state": "unknown"})
                    if failures >= self._max_poll_failures:
                        raise
                    delay = min(30.0, max(0.1, input.poll_interval_s) * 2**failures)
                    logger.warning(
                        "run %s: status unavailable (%s); asking again in %.1fs",
                        input.run_id,
                        exc,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                failures = 0
                activity.heartbeat({"handle": handle, "state": status.state})
                if status.state == RunStatus.RUNNING and not marked_running:
                    started = datetime_of(status.started_at) or dt.datetime.now(dt.UTC)
                    await asyncio.to_thread(self._mark_running, input.run_id, started)
                    marked_running = True
                    started_at = started_at or started
                if status.terminal:
                    return status
                if past_deadline(input.deadline_s, started_at):
                    stop = self._stop_past_deadline
                    return await asyncio.to_thread(stop, input, executor, handle)
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if details is not None and details.cancel_requested:
                logger.info(
                    "run %s: activity cancelled on request; cancelling its job", input.run_id
                )
                await asyncio.to_thread(executor.cancel, handle)
                await asyncio.to_thread(self._mark_cancelled, input.run_id)
            else:
                logger.info(
                    "run %s: activity interrupted (%s); the job keeps running",
                    input.run_id,
                    details,
                )
            raise

    def _stop_past_deadline(
        self, input: RunJobInput, executor: Executor, handle: Handle
    ) -> JobStatus:
        """Stop a job that ran past its deadline; its run ends as failed, saying why."""
        logger.warning(
            "run %s ran past its %.0fs deadline; stopping it", input.run_id, input.deadline_s
        )
        executor.cancel(handle)
        status = executor.status(handle)
        return replace(
            status,
            state=RunStatus.FAILED,
            reason="DeadlineExceeded",
            message=f"ran past its timeout of {input.deadline_s:.0f} s and was stopped",
        )

    def _mark_running(self, run_id: str, started: dt.datetime) -> None:
        with self._sessions.begin() as session:
            q.mark_running(session=session, run_id=run_id, started_at=started)

    def _mark_cancelled(self, run_id: str) -> bool:
        with self._sessions.begin() as session:
            return q.mark_cancel_requested(
                session=session, run_id=run_id, ended_at=dt.datetime.now(dt.UTC)
            )

    def _finish(
        self, input: RunJobInput, executor_name: str, handle: Handle, status: JobStatus
    ) -> RunJobResult:
        output_dir = Path(handle.get("output_dir") or self._output_dir(input))
        logs_path = self._artifacts.logs_dir(input.loop, input.run_id) / LOG_FILE
        self._save_logs(executor_name, handle, logs_path)
        outputs = finished_outputs.read_outputs(
            self._artifacts.root, output_dir, state=status.state, error=error_of(status)
        )
        metrics = outputs.metrics
        accelerators = status.accelerators
        cost = job_cost(
            status,
            accelerator_hour_price_usd=self._settings.accelerator_hour_price_usd,
            cpu_hour_price_usd=self._settings.cpu_hour_price_usd,
        )
        with self._sessions.begin() as session:
            outcome = q.RunOutcome(
                status=outputs.state,
                error=outputs.error,
                metrics=metrics,
                compute_seconds=cost.compute_seconds,
                cpu_seconds=status.cpu_seconds,
                cost_usd=cost.cost_usd + judge_cost_usd(metrics),
                accelerators=accelerators,
                started_at=datetime_of(status.started_at),
                ended_at=datetime_of(status.ended_at) or dt.datetime.now(dt.UTC),
                artifacts=q.RunArtifacts(
                    output_uri=path_to_uri(output_dir), logs_uri=path_to_uri(logs_path)
                ),
            )
            run = q.finish_run(session=session, run_id=input.run_id, outcome=outcome)
            if run.status == RunStatus.SUCCEEDED:
                record_job_outputs(session, run, output_dir, metrics, self._settings)
            result = result_of(run)
        observe_finished_job(
            FinishedJob(
                loop=input.loop,
                kind=input.kind,
                executor=executor_name,
                status=result.status,
                wall_seconds=status.wall_seconds,
                compute_seconds=result.compute_seconds,
                cost_usd=result.cost_usd,
            ),
            metrics,
        )
        logger.info(
            "run %s %s after %.1fs (%.1f compute-s, $%.4f)",
            input.run_id,
            result.status,
            status.wall_seconds,
            cost.compute_seconds,
            cost.cost_usd,
        )
        if result.status == RunStatus.FAILED and status.config_error:
            raise ApplicationError(
                f"job of run {input.run_id} failed on its spec or configuration: {result.error}",
                result_details(result),
                type="JobConfigError",
                non_retryable=True,
            )
        return result

    def _save_logs(self, executor_name: str, handle: Handle, path: Path) -> None:
        """Keep the job's logs beside its outputs (a cluster deletes pods, and their logs).

        The run directory is the job's to write, so the file is created with ``O_EXCL`` and
        no link is followed on the way: a dangling ``logs/job.log`` the job planted is left
        as it is, and nothing is written outside the run's own directory.
        """
        if os.path.lexists(path):
            return
        try:
            text = self._executor(executor_name).logs(handle)
        except ExecutorError as exc:
            logger.warning("could not save the logs of run %s: %s", handle.get("run_id"), exc)
            return
        try:
            fd = create_exclusive(self._artifacts.root, path)
        except (FileExistsError, UnsafeRunFile) as exc:
            logger.warning("not saving the logs of run %s: %s", handle.get("run_id"), exc)
            return
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as fh:
            fh.write(text)

    def _output_dir(self, input: RunJobInput) -> Path:
        return self._artifacts.run_dir(input.loop, input.run_id) / OUTPUT_SUBDIR

    def _executor(self, name: str) -> Executor:
        if name not in self._executor_cache:
            factory = self._executor_factory
            try:
                executor = factory[name] if isinstance(factory, Mapping) else factory(name)
            except KeyError:
                raise JobRequestError(f"no executor called {name!r} is configured") from None
            self._executor_cache[name] = executor
        return self._executor_cache[name]

    # cancel_job --------------------------------------------------------------------------

    @activity.defn(name="cancel_job")
    async def cancel_job(self, input: CancelJobInput) -> None:
        """Stop a run's job and mark the run cancelled. Idempotent; an ended run is left as is."""
        with log_context(loop=input.loop, run=input.run_id):
            try:
                await asyncio.to_thread(self._cancel, input)
            except ExecutorError as exc:
                raise _application_error(exc) from exc

    def _cancel(self, input: CancelJobInput) -> None:
        with self._sessions.begin() as session:
            run = q.get_run(session=session, run_id=input.run_id)
            if run is None or RunStatus(run.status).terminal:
                return
            executor_name, handle = run.executor, run.handle
        if handle is not None:
            # The job first: if this fails, the retry still sees the run as not ended.
            self._executor(executor_name).cancel(handle)
        self._mark_cancelled(input.run_id)

    # register_checkpoint -----------------------------------------------------------------

    @activity.defn(name="register_checkpoint")
    async def register_checkpoint(self, input: RegisterCheckpointInput) -> RegisterCheckpointResult:
        """Verify, copy into ``checkpoints/<id>``, upsert the row. Idempotent by content id."""
        with log_context(loop=input.loop, run=input.run_id):
            installed = await asyncio.to_thread(self._install_checkpoint, input)
            activity.heartbeat()
            return await asyncio.to_thread(self._record_checkpoint, input, installed)

    def _install_checkpoint(self, input: RegisterCheckpointInput) -> InstalledCheckpoint:
        """Verify the job's checkpoint and copy it into the store; both steps re-hash."""
        from services.training.checkpoint_manifest import CheckpointError

        invalid = f"checkpoint of run {input.run_id} is invalid"
        source = uri_to_path(input.checkpoint_dir_uri)
        with fails_as("CheckpointInvalid", CheckpointError, UnsafeRunFile, context=invalid):
            finished_outputs.refuse_links_in_job_output(self._artifacts.root, source)
            installed = install_checkpoint(source, self._artifacts)
        try:
            parent = resolve_parent(installed.parent, input.parent_checkpoint_id)
        except CheckpointRefused as exc:
            raise _refused(exc) from exc
        return replace(installed, parent=parent)

    def _record_checkpoint(
        self, input: RegisterCheckpointInput, installed: InstalledCheckpoint
    ) -> RegisterCheckpointResult:
        with self._sessions.begin() as session:
            try:
                row = register_run_checkpoint(
                    session=session, installed=installed, run_id=input.run_id
                )
            except CheckpointRefused as exc:
                raise _refused(exc) from exc
            result = RegisterCheckpointResult(
                checkpoint_id=row.id, uri=row.uri, size_bytes=row.size_bytes
            )
        logger.info("registered checkpoint %s from run %s", result.checkpoint_id[:12], input.run_id)
        return result


async def run_job_from_workflow(
    input: RunJobInput, start_to_close: timedelta | None = None
) -> RunJobResult:
    """For workflow code: every kind of job is followed, retried and cancelled the same way.

    The job's bound (``start_to_close``, else the ``JOB`` preset's) is its deadline from its
    first start, across attempts: a retry adopts the job but not a fresh bound.
    """
    bound = JOB.timeout if start_to_close is None else start_to_close
    return await workflow.execute_activity_method(
        JobActivities.run_job,
        replace(input, deadline_s=bound.total_seconds()),
        # A cancelled cycle closes only after its job is really stopped.
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        start_to_close_timeout=bound + DEADLINE_GRACE,
        heartbeat_timeout=JOB.heartbeat,
        retry_policy=JOB.retry,
    )


def _heartbeat_handle() -> Handle | None:
    """The handle from the previous attempt's last heartbeat, if there was one."""
    details = activity.info().heartbeat_details
    if details and isinstance(details[0], dict) and isinstance(details[0].get("handle"), dict):
        handle: Handle = details[0]["handle"]
        return handle
    return None


def _refused(exc: CheckpointRefused) -> ApplicationError:
    return ApplicationError(str(exc), type=exc.kind, non_retryable=True)


def _application_error(exc: ExecutorError) -> ApplicationError:
    return ApplicationError(str(exc), type=type(exc).__name__, non_retryable=not exc.retryable)
