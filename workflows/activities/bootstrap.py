"""Activities of a bootstrap cycle (workflows/bootstrap.py): whether an automatic bootstrap
may start, the cycle's base model and demonstrations, and the gate on the held-out set.

Idempotent: readiness only reads; the demonstrations are chosen and written once per cycle
(a retry reads the file and report the first attempt wrote into the train run's directory)
and the base model's row is keyed by its content; the gate is a pure function of stored
results. A bootstrap the loop cannot run (no base model, not a replay loop, ...) fails for
good with the reason (``BootstrapRefused``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session
from temporalio import activity
from temporalio.exceptions import ApplicationError

from services.artifacts import ArtifactStore, path_to_uri
from services.curation.bootstrap import (
    BootstrapRefused,
    BootstrapReport,
    select_demonstrations,
)
from services.db.queries import bootstrap as bq
from services.db.queries import cycles as q
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.evaluation.gate import decide
from services.logs import log_context
from services.loop.bootstrap import BootstrapProblem, check_request, resolve_base
from services.loop.policies import RECORDED, GatePolicy, TrainingProfile
from workflows.activities.transactions import loop_cycle, transaction
from workflows.ids import run_id_for
from workflows.payloads.bootstrap import (
    BootstrapReadiness,
    BootstrapReadinessInput,
    PrepareBootstrapInput,
    PrepareBootstrapResult,
)
from workflows.payloads.gate import GateInput, GateResult

logger = logging.getLogger(__name__)

DEMONSTRATIONS_FILE = "bootstrap.jsonl"
REPORT_FILE = "bootstrap-report.json"


class BootstrapActivities:
    """A bootstrap's reads and files: the session factory and the artifact store come in."""

    def __init__(self, session_factory: SessionFactory, artifacts: ArtifactStore) -> None:
        self._sessions = session_factory
        self._artifacts = artifacts

    @activity.defn(name="bootstrap_readiness")
    def readiness(self, input: BootstrapReadinessInput) -> BootstrapReadiness:
        """Read-only. Looks for demonstrations only when curation has seen new traces since
        the last look (``curated_seen``): a loop waiting for its first champion is asked at
        every trigger check."""
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop)
            curated = bq.curated_trace_count(session=session, loop_id=loop.id)
            if curated == input.curated_seen or loop.champion_checkpoint_id is not None:
                return BootstrapReadiness(ready=False, curated=curated)
            try:
                selection = select_demonstrations(session, loop=loop, limit=input.min_successes)
            except BootstrapRefused as exc:
                return BootstrapReadiness(ready=False, curated=curated, summary=str(exc))
        used = selection.report.used
        return BootstrapReadiness(
            ready=used >= input.min_successes,
            curated=curated,
            used=used,
            summary=selection.report.summary(),
        )

    @activity.defn(name="prepare_bootstrap")
    def prepare(self, input: PrepareBootstrapInput) -> PrepareBootstrapResult:
        """The base model (recorded) and the demonstrations' task file, chosen once per cycle
        and kept in the train run's directory, where the job reads it; the report goes on
        the cycle's row (``trigger_detail.bootstrap``)."""
        with (
            log_context(loop=input.loop, cycle=input.cycle),
            _refusals(),
            transaction(self._sessions) as session,
        ):
            loop, cycle = loop_cycle(session, input.loop, input.cycle)
            profile = TrainingProfile.model_validate(loop.training_profile or {}, context=RECORDED)
            check_request(loop, profile, force=True)
            base = resolve_base(
                session, self._artifacts, loop=loop, profile=profile, ref=input.base_checkpoint_id
            )
            run_dir = self._artifacts.run_dir(
                loop.name, run_id_for(loop.name, input.cycle, "train")
            )
            report, path = self._demonstrations(session, run_dir, input)
            uri = path_to_uri(path) if report.used else None
            cycle.trigger_detail = {
                **(cycle.trigger_detail or {}),
                "bootstrap": {
                    **report.to_json(),
                    "base_checkpoint": base.checkpoint_id,
                    "demonstrations": uri,
                },
            }
            logger.info("bootstrap of %s: %s", loop.name, report.summary())
            return PrepareBootstrapResult(
                base_checkpoint_id=base.checkpoint_id,
                base_uri=base.uri,
                demonstrations_uri=uri,
                used=report.used,
                summary=report.summary(),
                report=report.to_json(),
            )

    def _demonstrations(
        self, session: Session, run_dir: Path, input: PrepareBootstrapInput
    ) -> tuple[BootstrapReport, Path]:
        """The report and the task file of the cycle's demonstrations: the first attempt's,
        or chosen and written now (the task file last, the report beside it)."""
        path, report_path = run_dir / DEMONSTRATIONS_FILE, run_dir / REPORT_FILE
        if report_path.is_file():
            report = BootstrapReport.from_json(json.loads(report_path.read_text()))
            if report.used == 0 or path.is_file():
                return report, path
        loop = require_loop(session=session, name=input.loop)
        selection = select_demonstrations(session, loop=loop, limit=input.max_demonstrations)
        if selection.report.used:
            selection.write(path)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = report_path.with_name(f".{report_path.name}.tmp")
        tmp.write_text(json.dumps(selection.report.to_json(), indent=2))
        tmp.replace(report_path)
        return selection.report, path

    @activity.defn(name="bootstrap_gate")
    def gate(self, input: GateInput) -> GateResult:
        """The gate's own decision (services.evaluation.gate.decide) on the frozen held-out
        set, the base model in the champion's place: a pure function of stored results."""
        with transaction(self._sessions) as session:
            _, cycle = loop_cycle(session, input.loop, input.cycle)
            base, adapter = q.paired_results(
                session=session,
                cycle=cycle,
                champion_id=input.champion_checkpoint_id,
                candidate_id=input.candidate_checkpoint_id,
                task_set="heldout",
            )
        policy = GatePolicy(
            confidence=input.confidence,
            min_improvement_points=input.min_improvement_points,
            regression_tolerance_points=input.regression_tolerance_points,
            min_discordant_pairs=input.min_discordant_pairs,
        )
        decision = decide(base, adapter, [], [], policy, seed=input.cycle)
        statistics = dict(decision.statistics)
        # The comparison that decided is the held-out one: it is the gate's points and the
        # points gained alike (services.loop.points reads both keys).
        if "eval" in statistics:
            statistics["heldout"] = statistics["eval"]
            statistics["heldout_points"] = statistics["delta_points"]
        statistics.update(decided_on="heldout", baseline="base_model")
        return GateResult(decision.decision, _bootstrap_words(decision.reason), statistics)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.readiness, self.prepare, self.gate]


def _bootstrap_words(reason: str) -> str:
    """The gate's reason as a bootstrap reads: the base model stands where the champion does
    and the tasks are the held-out set's."""
    words = reason.replace("eval tasks", "held-out tasks").replace("champion", "base model")
    return f"bootstrap judged against the base model on the held-out set: {words}"


@contextmanager
def _refusals() -> Iterator[None]:
    """A bootstrap the loop cannot run fails for good, with the reason."""
    try:
        yield
    except (BootstrapProblem, BootstrapRefused) as exc:
        raise ApplicationError(str(exc), type="BootstrapRefused", non_retryable=True) from exc
