"""Activities of the loop: its configuration, the cycle's records, the gate, promotion and
the cost ledger.

Every activity here is idempotent: rows are keyed by (loop, cycle number), a decision is
unique per cycle, an evaluation per (cycle, checkpoint, task set), and updates set absolute
values. A retried activity therefore changes nothing twice. Errors that cannot succeed on
retry (an unknown loop, a bad policy) are raised as non-retryable ``ApplicationError``.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy.orm import Session
from temporalio import activity
from temporalio.exceptions import ApplicationError

from services.artifacts import uri_to_path
from services.curation.policy import CurationPolicy, CurationPolicyError
from services.db.models import Cycle, Loop
from services.db.queries import cycles as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.queries.serving_ledger import record_sample, serving_loop_names
from services.db.session import SessionFactory
from services.evaluation.gate import decide, judge_only_count
from services.evaluation.probes import ProbeFileError, ProbeSet, read_listed_probes
from services.evaluation.results import ResultsFileError, pass_at_1, read_results
from services.evaluation.stats import (
    compare_paired,
    mean_interval,
    newcombe_interval,
    wilson_interval,
)
from services.logs import log_context
from services.loop.ledger import ServingLedger
from services.loop.policies import RECORDED, GatePolicy, ServingTarget, parse_policies
from services.metrics import (
    LOOP_CYCLES,
    LOOP_PASS_RATE,
    LOOP_POINTS_PER_DOLLAR,
    LOOP_PROMOTIONS,
    LOOP_SPEND,
)
from services.serving.attestation import TraceAttestation
from services.serving.base import DeployFailed, ServingError
from services.serving.delivery import DeliveryProof, not_verified
from services.serving.usage import UsageUnavailable, VersionUsage
from workflows.activities.errors import fails_as
from workflows.shared import (
    CloseCycleInput,
    CloseCycleResult,
    DeployInput,
    DeployResult,
    EvaluationSummary,
    FinishRollbackInput,
    GateInput,
    GateResult,
    LiveStats,
    LiveStatsInput,
    LoopConfig,
    LoopConfigInput,
    PromotionStatusInput,
    RecordDecisionInput,
    RecordDecisionResult,
    RecordEvaluationInput,
    RollbackInput,
    RollbackPlan,
    RollbackResult,
    ServingLedgerInput,
    ServingLedgerResult,
    StageInput,
    StartCycleInput,
    StartCycleResult,
)

logger = logging.getLogger(__name__)


class ServingDeployer(Protocol):
    """Deploys a checkpoint to a loop's serving target and returns the version now served."""

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, checkpoint_uri: str
    ) -> str: ...


# How the canary tells the traces a loop's serving target served (by the model server's
# signed response ids) from those that only say so; None: only the clients' word exists.
Attestation = Callable[[dict[str, Any]], TraceAttestation | None]


class DeliveryProver(Protocol):
    """Proves a deploy's delivery with the checkpoint's probe set (None: it has none)."""

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, probes: ProbeSet | None
    ) -> DeliveryProof: ...


class LoopActivities:
    def __init__(
        self,
        session_factory: SessionFactory,
        deploy: ServingDeployer,
        *,
        attestation: Attestation | None = None,
        serving_ledger: ServingLedger | None = None,
        prove: DeliveryProver | None = None,
    ) -> None:
        """``attestation``: how the canary tells served traces from claimed ones (none: it
        trusts the clients); ``serving_ledger``: where the serving ledger's samples are read
        (none: not kept); ``prove``: proof of delivery after every deploy (the worker's is
        ``ServingTargets.prove``; without one, deploys are noted as not verified)."""
        self._sessions = session_factory
        self._deploy = deploy
        self._attestation = attestation
        self._serving_ledger = serving_ledger
        self._prove = prove

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        """A transaction whose 'not found' and bad-policy errors are not worth retrying."""
        with fails_as("NotFound", NotFound), self._sessions.begin() as session:
            yield session

    def _deploy_verified(
        self, serving_target: ServingTarget, checkpoint_id: str, checkpoint_uri: str
    ) -> str:
        """Deploy; a serving error is retried only when the target says a retry can help."""
        try:
            return self._deploy(_config(serving_target), checkpoint_id, checkpoint_uri)
        except ServingError as exc:
            raise ApplicationError(
                str(exc), type=type(exc).__name__, non_retryable=not exc.retryable
            ) from exc

    # Configuration -----------------------------------------------------------------------

    @activity.defn(name="load_loop_config")
    def load_loop_config(self, input: LoopConfigInput) -> LoopConfig:
        """Read-only, so trivially idempotent."""
        with self._transaction() as session:
            loop = require_loop(session=session, name=input.loop)
            with fails_as(
                "InvalidPolicy",
                ValidationError,
                CurationPolicyError,
                context=f"loop {input.loop!r} has an invalid policy",
            ):
                trigger, gate, training, serving = parse_policies(
                    loop.trigger_policy,
                    loop.gate_policy,
                    loop.training_profile,
                    loop.serving_target,
                )
                curation = CurationPolicy.from_json(loop.curation_policy)
            champion_uri = loop.champion.uri if loop.champion is not None else None
            ledger = q.loop_ledger(session=session, loop=loop)
            return LoopConfig(
                loop=loop.name,
                loop_id=loop.id,
                status=loop.status,
                environment=loop.environment,
                executor=loop.executor,
                champion_checkpoint_id=loop.champion_checkpoint_id,
                champion_uri=champion_uri,
                training_profile=training,
                serving_target=serving,
                trigger_policy=trigger,
                gate_policy=gate,
                curation_policy=curation,
                budget_usd=float(loop.budget_usd) if loop.budget_usd is not None else None,
                spent_usd=ledger.spent_usd,
                last_cycle_number=q.last_cycle_number(session=session, loop=loop),
            )

    # Cycle records -----------------------------------------------------------------------

    @activity.defn(name="start_cycle")
    def start_cycle(self, input: StartCycleInput) -> StartCycleResult:
        """Keyed by (loop, number): a retry returns the cycle the first attempt opened."""
        with log_context(loop=input.loop, cycle=input.number), self._transaction() as session:
            loop = require_loop(session=session, name=input.loop, for_update=True)
            cycle = q.open_cycle(
                session=session,
                loop=loop,
                number=input.number,
                trigger=input.trigger,
                trigger_detail=input.trigger_detail,
                workflow_id=input.workflow_id,
            )
            champion_id = cycle.champion_checkpoint_id
            champion_uri = (
                q.get_checkpoint(session=session, checkpoint_id=champion_id).uri
                if champion_id
                else None
            )
            logger.info("cycle %s started by %s", input.number, input.trigger)
            return StartCycleResult(cycle.id, champion_id, champion_uri)

    @activity.defn(name="set_cycle_stage")
    def set_cycle_stage(self, input: StageInput) -> None:
        """Sets absolute values (stage, ids, the stage's end time)."""
        with self._transaction() as session:
            _, cycle = _loop_cycle(session, input.loop, input.cycle)
            q.set_stage(
                session=session,
                cycle=cycle,
                stage=input.stage,
                dataset_id=input.dataset_id,
                candidate_checkpoint_id=input.candidate_checkpoint_id,
            )

    @activity.defn(name="record_evaluation")
    def record_evaluation(self, input: RecordEvaluationInput) -> EvaluationSummary:
        """Unique per (cycle, checkpoint, task set): a retry returns the stored evaluation."""
        with fails_as("BadEvaluationOutput", ResultsFileError):
            rows = read_results(uri_to_path(input.output_uri))
        ci = mean_interval([pass_at_1(row) for row in rows]) if rows else (0.0, 0.0)
        with self._transaction() as session:
            loop, cycle = _loop_cycle(session, input.loop, input.cycle)
            evaluation = q.record_evaluation(
                session=session,
                loop=loop,
                cycle=cycle,
                checkpoint_id=input.checkpoint_id,
                dataset_id=input.dataset_id,
                task_set=input.task_set,
                run_id=input.run_id,
                results=rows,
                ci=ci,
            )
            if input.task_set == "eval":
                LOOP_PASS_RATE.labels(input.loop, input.role).set(evaluation.pass_rate)
            return EvaluationSummary(
                evaluation_id=evaluation.id,
                role=input.role,
                checkpoint_id=input.checkpoint_id,
                task_set=input.task_set,
                n=evaluation.n,
                passed=evaluation.passed,
                pass_rate=evaluation.pass_rate,
                ci_low=evaluation.ci_low,
                ci_high=evaluation.ci_high,
            )

    # Gate and decision -------------------------------------------------------------------

    @activity.defn(name="gate")
    def gate(self, input: GateInput) -> GateResult:
        """A pure function of stored per-task results: the same inputs, the same decision.

        The decision reads the eval set and the regression suite only. The held-out
        comparison (when the cycle evaluated one) rides along in the statistics as
        ``heldout`` and ``heldout_points``: the points a promotion would gain, measured on
        tasks the gate never saw and training never touched.
        """
        with self._transaction() as session:
            _, cycle = _loop_cycle(session, input.loop, input.cycle)
            eval_pairs, regression_pairs, heldout_pairs = (
                q.paired_results(
                    session=session,
                    cycle=cycle,
                    champion_id=input.champion_checkpoint_id,
                    candidate_id=input.candidate_checkpoint_id,
                    task_set=task_set,
                )
                for task_set in ("eval", "regression", "heldout")
            )
            # What sampling still reaches beside pass@1, for both sides of the comparison.
            reach = {
                role: q.pass_at_k_of(
                    session=session, cycle=cycle, checkpoint_id=checkpoint, task_set="eval"
                )
                for role, checkpoint in (
                    ("champion", input.champion_checkpoint_id),
                    ("candidate", input.candidate_checkpoint_id),
                )
            }
            eval_specs = q.evaluated_task_specs(
                session=session,
                cycle=cycle,
                checkpoint_id=input.candidate_checkpoint_id,
                task_set="eval",
            )
        policy = GatePolicy(
            confidence=input.confidence,
            min_improvement_points=input.min_improvement_points,
            regression_tolerance_points=input.regression_tolerance_points,
            min_discordant_pairs=input.min_discordant_pairs,
        )
        decision = decide(
            *eval_pairs,
            *regression_pairs,
            policy,
            seed=input.cycle,
            judge_only_tasks=judge_only_count(eval_specs),
        )
        statistics = dict(decision.statistics)
        statistics["pass_at_k"] = reach
        if heldout_pairs[0]:
            heldout = compare_paired(*heldout_pairs, confidence=input.confidence, seed=input.cycle)
            statistics["heldout"] = heldout.to_dict()
            statistics["heldout_points"] = heldout.delta_points
        return GateResult(decision.decision, decision.reason, statistics)

    @activity.defn(name="record_decision")
    def record_decision(self, input: RecordDecisionInput) -> RecordDecisionResult:
        """At most one decision per cycle (unique key): a retry returns the first decision."""
        with log_context(loop=input.loop, cycle=input.cycle), self._transaction() as session:
            loop, cycle = _loop_cycle(session, input.loop, input.cycle)
            promotion = q.record_decision(
                session=session,
                loop=loop,
                cycle=cycle,
                decision=input.decision,
                reason=input.reason,
                statistics=input.statistics,
                candidate_checkpoint_id=input.candidate_checkpoint_id,
                previous_checkpoint_id=input.previous_checkpoint_id,
                decided_by=input.decided_by,
            )
            if promotion.decision == input.decision:
                LOOP_PROMOTIONS.labels(input.loop, input.decision).inc()
            logger.info("gate decided %s: %s", promotion.decision, promotion.reason)
            return RecordDecisionResult(promotion.id, promotion.decision)

    # Promotion ---------------------------------------------------------------------------

    @activity.defn(name="deploy_checkpoint")
    def deploy_checkpoint(self, input: DeployInput) -> DeployResult:
        """Deploying the version already served is a no-op for every serving target.

        A promotion's deploy names its cycle, and is refused (non-retryable) when it would
        let serving slip back: see :meth:`_refuse_slipping_back`.
        """
        if input.cycle is not None:
            with self._transaction() as session:
                _refuse_slipping_back(session, input)
        with log_context(loop=input.loop):
            served = self._deploy_verified(
                input.serving_target, input.checkpoint_id, input.checkpoint_uri
            )
        if served != input.checkpoint_id:
            raise ApplicationError(
                f"the serving target reports version {served!r} after deploying "
                f"{input.checkpoint_id!r}",
                type="DeployNotVerified",
            )
        self._sample_serving(input.loop, served, input.serving_target)
        proof = self._prove_delivery(input)
        return DeployResult(
            served_version=served, deployed_at=_now().isoformat(), delivery=proof.note
        )

    def _prove_delivery(self, input: DeployInput) -> DeliveryProof:
        """Proof of delivery (``services.serving.delivery``) of a verified deploy, kept on
        the promotion it belongs to. A mismatch or a bad probe set fails the deploy (not
        retried: the same weights answer the same); an unreachable server may be retried."""
        try:
            probes = self._probe_set(input.loop, input.checkpoint_id)
            if self._prove is None:
                proof = not_verified(input.checkpoint_id, "not verified: no prover configured")
            else:
                with log_context(loop=input.loop):
                    proof = self._prove(_config(input.serving_target), input.checkpoint_id, probes)
        except (ProbeFileError, DeployFailed) as exc:
            bad_file = isinstance(exc, ProbeFileError)
            reason = f"bad probe set: {exc}" if bad_file else str(exc)
            self._record_delivery(input, not_verified(input.checkpoint_id, reason))
            raise ApplicationError(
                reason, type="BadProbeSet" if bad_file else "DeliveryNotProven", non_retryable=True
            ) from exc
        except ServingError as exc:
            raise ApplicationError(
                str(exc), type=type(exc).__name__, non_retryable=not exc.retryable
            ) from exc
        if not proof.verified:
            logger.warning("loop %s: deploy of %s: %s", input.loop, input.checkpoint_id, proof.note)
        self._record_delivery(input, proof)
        return proof

    def _probe_set(self, loop_name: str, checkpoint_id: str) -> ProbeSet | None:
        """The checkpoint's probe set, read only through the listing of the eval run that
        wrote it (held-out run first); None when no run of the loop lists one."""
        with self._transaction() as session:
            loop = require_loop(session=session, name=loop_name)
            runs = q.evaluation_runs_of(session=session, loop=loop, checkpoint_id=checkpoint_id)
        for output_uri, metrics in runs:
            if output_uri and "probes" in metrics:
                return read_listed_probes(uri_to_path(output_uri), metrics)
        return None

    def _record_delivery(self, input: DeployInput, proof: DeliveryProof) -> None:
        """On the cycle's promotion (a candidate or restore deploy) or the held promotion an
        operator rollback undoes: the dashboard's loop page shows it."""
        with self._transaction() as session:
            loop = require_loop(session=session, name=input.loop)
            if input.cycle is not None:
                promotion = q.cycle_promotion(
                    session=session,
                    cycle=q.get_cycle(session=session, loop=loop, number=input.cycle),
                )
            else:
                promotion = q.last_held_promotion(session=session, loop=loop)
            if promotion is not None:
                q.record_delivery(
                    session=session,
                    promotion=promotion,
                    purpose=input.purpose,
                    proof=proof.to_dict(),
                )

    @activity.defn(name="live_stats")
    def live_stats(self, input: LiveStatsInput) -> LiveStats:
        """Read-only. Where the serving target signs its responses, only the traces whose
        response ids it signed for their version count: an agent's say-so cannot move the
        canary."""
        with self._transaction() as session:
            loop = require_loop(session=session, name=input.loop)
            attested = self._attestation(loop.serving_target) if self._attestation else None
            counts = q.live_counts(
                session=session,
                loop=loop,
                model_version=input.model_version,
                since=_parse(input.since),
                until=_parse(input.until),
                limit=input.limit,
                attested=attested,
            )
        if counts.n == 0:
            return LiveStats(n=0, successes=0, success_rate=None, unattested=counts.unattested)
        low, high = wilson_interval(counts.successes, counts.n)
        rate = counts.successes / counts.n
        return LiveStats(counts.n, counts.successes, rate, low, high, counts.unattested)

    @activity.defn(name="update_promotion")
    def update_promotion(self, input: PromotionStatusInput) -> None:
        """Sets absolute values; timestamps are set once and kept on retries."""
        with log_context(loop=input.loop), self._transaction() as session:
            q.update_promotion(
                session=session,
                promotion_id=input.promotion_id,
                status=input.status,
                reason=input.reason,
                set_champion=input.set_champion,
                timestamp_field=input.timestamp_field,
            )

    @activity.defn(name="rollback_champion")
    def rollback_champion(self, input: RollbackInput) -> RollbackResult:
        """Operator rollback in one activity, as LoopWorkflow ran it before its
        rollback-deploy patch (kept for those histories): plan, deploy, record, each step as
        :meth:`plan_rollback`, ``deploy_checkpoint`` and :meth:`finish_rollback` do it, so
        the deploy never holds the loop's row lock and a failed one is recorded, not raised.
        """
        plan = self.plan_rollback(input)
        if plan.promotion_id is None or plan.checkpoint_id is None:
            return RollbackResult(False, plan.reason)
        error: str | None = None
        try:
            with log_context(loop=input.loop):
                served = self._deploy_verified(
                    plan.serving_target, plan.checkpoint_id, plan.checkpoint_uri or ""
                )
            if served != plan.checkpoint_id:
                error = f"serving {served!r} after the deploy, expected {plan.checkpoint_id!r}"
            else:
                self._sample_serving(input.loop, served, plan.serving_target)
                self._prove_delivery(
                    DeployInput(
                        input.loop,
                        plan.serving_target,
                        plan.checkpoint_id,
                        plan.checkpoint_uri or "",
                        purpose="rollback",
                    )
                )
        except ApplicationError as exc:
            error = str(exc)
        return self.finish_rollback(
            FinishRollbackInput(
                input.loop, input.reason, plan.promotion_id, plan.checkpoint_id, error
            )
        )

    @activity.defn(name="plan_rollback")
    def plan_rollback(self, input: RollbackInput) -> RollbackPlan:
        """Read-only: the held promotion to undo and the checkpoint to serve again. The
        deploy runs after this transaction, never inside it (a rollout takes minutes)."""
        with log_context(loop=input.loop), self._transaction() as session:
            loop = require_loop(session=session, name=input.loop)
            promotion = q.last_held_promotion(session=session, loop=loop)
            if promotion is None or promotion.previous_checkpoint_id is None:
                return RollbackPlan(None, "no promotion to roll back")
            previous = q.get_checkpoint(
                session=session, checkpoint_id=promotion.previous_checkpoint_id
            )
            return RollbackPlan(
                promotion.id,
                checkpoint_id=previous.id,
                checkpoint_uri=previous.uri,
                serving_target=ServingTarget.model_validate(
                    loop.serving_target or {}, context=RECORDED
                ),
            )

    @activity.defn(name="finish_rollback")
    def finish_rollback(self, input: FinishRollbackInput) -> RollbackResult:
        """Record how the rollback's deploy ended, on the loop's row lock.

        Served: the promotion is rolled back and the previous champion is the champion again.
        Failed: a ``rollback`` promotion row with status ``failed`` and the error says so
        (the dashboard's events and ``GET /v1/loops/{loop}/status`` show it); the champion
        and the held promotion stay as they were. Idempotent: a retry finds the promotion
        rolled back already, or the same failure recorded.
        """
        with log_context(loop=input.loop), self._transaction() as session:
            loop = require_loop(session=session, name=input.loop, for_update=True)
            promotion = q.get_promotion(session=session, promotion_id=input.promotion_id)
            if input.error is not None:
                return self._record_failed_rollback(session, loop, input)
            if promotion.status == "held":
                q.update_promotion(
                    session=session,
                    promotion_id=promotion.id,
                    status="rolled_back",
                    reason=f"rolled back by operator: {input.reason}",
                    set_champion=input.checkpoint_id,
                    timestamp_field="rolled_back_at",
                )
                session.add(
                    _rollback_record(
                        loop, promotion.candidate_checkpoint_id, input.checkpoint_id, input.reason
                    )
                )
                LOOP_PROMOTIONS.labels(input.loop, "rollback").inc()
            return RollbackResult(
                True, f"serving {input.checkpoint_id} again: {input.reason}", input.checkpoint_id
            )

    def _record_failed_rollback(
        self, session: Session, loop: Loop, input: FinishRollbackInput
    ) -> RollbackResult:
        reason = (
            f"rollback to {input.checkpoint_id} failed ({input.reason}): {input.error}; "
            f"the champion is still {loop.champion_checkpoint_id}"
        )
        if not q.has_rollback_record(session=session, loop=loop, status="failed", reason=reason):
            record = _rollback_record(
                loop, loop.champion_checkpoint_id, input.checkpoint_id, reason, status="failed"
            )
            session.add(record)
        logger.warning("loop %s: %s", input.loop, reason)
        return RollbackResult(False, reason)

    # Accounting --------------------------------------------------------------------------

    @activity.defn(name="close_cycle")
    def close_cycle(self, input: CloseCycleInput) -> CloseCycleResult:
        """Sets absolute values from the runs of the cycle; the budget check reads totals.

        Records the cycle's three numbers with their intervals: held-out points (the
        ledger's), the gate's eval-set points, and the live delta of the canary's samples.
        """
        with log_context(loop=input.loop, cycle=input.cycle), self._transaction() as session:
            loop, cycle = _loop_cycle(session, input.loop, input.cycle, for_update=True)
            first_close = cycle.ended_at is None
            live_points, detail = _points_detail(session, cycle, input)
            q.close_cycle(
                session=session,
                cycle=cycle,
                outcome=input.outcome,
                detail=input.detail,
                points_gained=input.points_gained,
                candidate_checkpoint_id=input.candidate_checkpoint_id,
                gate_points=input.gate_points,
                live_points=live_points,
                points_detail=detail,
            )
            session.flush()
            ledger = q.loop_ledger(session=session, loop=loop)
            exhausted = (
                loop.budget_usd is not None and Decimal(str(ledger.spent_usd)) >= loop.budget_usd
            )
            if exhausted and loop.status == "active":
                loop.status = "paused"
                loop.status_reason = (
                    f"budget of ${loop.budget_usd} spent (${ledger.spent_usd:.2f}); raise the "
                    "budget and resume"
                )
            champion = loop.champion_checkpoint_id
            if first_close:
                LOOP_CYCLES.labels(input.loop, input.outcome).inc()
            LOOP_SPEND.labels(input.loop).set(ledger.spent_usd)
            if ledger.points_per_dollar is not None:
                LOOP_POINTS_PER_DOLLAR.labels(input.loop).set(ledger.points_per_dollar)
            result = CloseCycleResult(
                cost_usd=float(cycle.cost_usd),
                compute_seconds=cycle.compute_seconds,
                cumulative_cost_usd=ledger.spent_usd,
                cumulative_points=ledger.points_gained,
                points_per_dollar=ledger.points_per_dollar,
                budget_exhausted=exhausted,
            )
        self._sample_serving(input.loop, champion)
        return result

    # Serving ledger ----------------------------------------------------------------------

    @activity.defn(name="sample_serving_ledgers")
    def sample_serving_ledgers(self, input: ServingLedgerInput) -> ServingLedgerResult:
        """Between deploys: every loop that serves (not archived, a serving target) gets its
        server's counters added to its open tenure, so the current champion's figures are
        as fresh as the schedule (workflows/schedules.py). Idempotent: a retried sample
        adds the growth since the last one, which is zero."""
        with self._transaction() as session:
            names = serving_loop_names(session=session, limit=input.max_loops)
        result = ServingLedgerResult()
        for name in names:
            if activity.in_activity():  # tests call it as a method
                activity.heartbeat(name)
            if self._sample_serving(name, None):
                result.sampled += 1
            else:
                result.unreadable += 1
        return result

    def _sample_serving(
        self,
        loop_name: str,
        served_version: str | None,
        serving_target: ServingTarget | None = None,
    ) -> bool:
        """Add a sample of the serving target's counters to the loop's open tenure, and end
        it when ``served_version`` replaces it (services.loop.ledger). ``serving_target``:
        the one just deployed to (default: the loop's). An unreadable server is logged, not
        raised: a deploy or a cycle never fails for the ledger's sake. True when the
        counters were read (or there is nothing to read)."""
        if self._serving_ledger is None:
            return True
        config = _config(serving_target) if serving_target is not None else None
        if config is None:
            with self._transaction() as session:
                loop = require_loop(session=session, name=loop_name)
                config = dict(loop.serving_target or {})
        if config.get("kind") == "none":
            return True
        usage: Mapping[str, VersionUsage] | None
        try:
            usage = self._serving_ledger.read(config)
        except (UsageUnavailable, ServingError) as exc:
            logger.warning("loop %s: serving ledger sample skipped: %s", loop_name, exc)
            usage = None
        with self._transaction() as session:
            loop = require_loop(session=session, name=loop_name, for_update=True)
            record_sample(
                session=session,
                loop=loop,
                served_version=served_version,
                usage=usage,
                now=_now(),
                prices=self._serving_ledger.prices,
            )
        return usage is not None

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.load_loop_config,
            self.start_cycle,
            self.set_cycle_stage,
            self.record_evaluation,
            self.gate,
            self.record_decision,
            self.deploy_checkpoint,
            self.live_stats,
            self.update_promotion,
            self.rollback_champion,
            self.plan_rollback,
            self.finish_rollback,
            self.close_cycle,
            self.sample_serving_ledgers,
        ]


def _loop_cycle(
    session: Session, loop_name: str, number: int, *, for_update: bool = False
) -> tuple[Loop, Cycle]:
    """The loop and its cycle an input names; either missing is ``NotFound``."""
    loop = require_loop(session=session, name=loop_name, for_update=for_update)
    return loop, q.get_cycle(session=session, loop=loop, number=number)


def _refuse_slipping_back(session: Session, input: DeployInput) -> None:
    """Refuse a promotion's deploy that would move serving backwards (issue: a restarted
    loop replaying an old cycle's records).

    A candidate deploy must be the cycle's own candidate, from the loop's newest cycle,
    trained from the champion serving now and not older than it; a restore must put back
    the champion itself.
    """
    assert input.cycle is not None
    loop, cycle = _loop_cycle(session, input.loop, input.cycle)
    champion_id = loop.champion_checkpoint_id
    problem: str | None = None
    if input.purpose == "restore":
        if champion_id is not None and input.checkpoint_id != champion_id:
            problem = f"restoring {input.checkpoint_id!r}, but the champion is {champion_id!r}"
    elif cycle.candidate_checkpoint_id != input.checkpoint_id:
        problem = (
            f"{input.checkpoint_id!r} is not cycle {cycle.number}'s candidate "
            f"({cycle.candidate_checkpoint_id!r})"
        )
    elif (latest := q.last_cycle_number(session=session, loop=loop)) > cycle.number:
        problem = f"cycle {cycle.number} is not the loop's newest cycle ({latest} is)"
    elif champion_id is not None and cycle.champion_checkpoint_id != champion_id:
        problem = (
            f"cycle {cycle.number} trained from {cycle.champion_checkpoint_id!r}, but the "
            f"champion is now {champion_id!r}"
        )
    elif champion_id is not None:
        candidate = q.get_checkpoint(session=session, checkpoint_id=input.checkpoint_id)
        champion = q.get_checkpoint(session=session, checkpoint_id=champion_id)
        if candidate.id != champion.id and candidate.created_at < champion.created_at:
            problem = f"{candidate.id!r} is older than the champion {champion.id!r}"
    if problem is not None:
        raise ApplicationError(
            f"refusing to deploy for loop {input.loop!r}: {problem}",
            type="StaleCheckpoint",
            non_retryable=True,
        )


def _points_detail(
    session: Session, cycle: Cycle, input: CloseCycleInput
) -> tuple[float | None, dict[str, Any]]:
    """The live delta (points) and every number's interval, for ``cycles.points_detail``."""
    detail: dict[str, Any] = {}
    promotion = q.cycle_promotion(session=session, cycle=cycle)
    statistics = promotion.statistics if promotion is not None else {}
    for name, key in (("gate", "eval"), ("heldout", "heldout")):
        comparison = statistics.get(key)
        if isinstance(comparison, dict):
            detail[name] = {
                "points": 100.0 * float(comparison.get("delta", 0.0)),
                "ci_low_points": 100.0 * float(comparison.get("ci_low", 0.0)),
                "ci_high_points": 100.0 * float(comparison.get("ci_high", 0.0)),
                "n": int(comparison.get("n", 0)),
                "champion_rate": comparison.get("champion_rate"),
                "candidate_rate": comparison.get("candidate_rate"),
            }
    live_points: float | None = None
    before, after = input.live_baseline, input.live_canary
    if before is not None and after is not None and before.n > 0 and after.n > 0:
        live_points = 100.0 * (after.successes / after.n - before.successes / before.n)
        low, high = newcombe_interval(before.successes, before.n, after.successes, after.n)
        detail["live"] = {
            "points": live_points,
            "ci_low_points": 100.0 * low,
            "ci_high_points": 100.0 * high,
            "n_before": before.n,
            "successes_before": before.successes,
            "n_after": after.n,
            "successes_after": after.successes,
        }
    return live_points, detail


def _rollback_record(
    loop: Loop,
    from_checkpoint: str | None,
    to_checkpoint: str,
    reason: str,
    *,
    status: str = "rolled_back",
) -> Any:
    from services.db.models import Promotion

    return Promotion(
        loop_id=loop.id,
        cycle_id=None,
        decision="rollback",
        status=status,
        reason=reason,
        candidate_checkpoint_id=to_checkpoint,
        previous_checkpoint_id=from_checkpoint,
        serving_target=loop.serving_target,
        decided_by="operator",
        rolled_back_at=_now() if status == "rolled_back" else None,
    )


def _config(serving_target: ServingTarget) -> dict[str, Any]:
    """A payload's serving target as the mapping the serving targets read (services.serving
    parses it again, as recorded)."""
    return serving_target.model_dump(mode="json")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _parse(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value else None
