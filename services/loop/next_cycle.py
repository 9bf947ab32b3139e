"""What a loop's next cycle waits for, in words its operator can act on.

A new loop that has received a few traces sits "waiting for a trigger", and without this
module nothing says which: a cycle starts once ``trigger_policy.min_new_tasks`` new train
tasks are curated (or on drift, the maximum interval, an operator's run-now), its snapshot
needs at least one eval task, and it trains from the champion, so a loop with none can only
fail. :func:`read_next_cycle` counts each from Postgres; :meth:`NextCycle.waits_for` says
what is missing, each with the command that supplies it, and :meth:`NextCycle.curation_note`
when the traces not curated yet will be. The loop page, ``ratchet loop show``, ``ratchet
loop status`` and the run-now action all say it in these words.

When curation next runs is the loop workflow's to know (it curates at each trigger check,
every ``trigger_policy.check_interval_s`` while it waits): :class:`WorkflowClock` carries
what its status query answered, or says it was not asked (the dashboard reads Postgres only).
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy.orm import Session

from services.curation.policy import CurationPolicy, CurationPolicyError
from services.db.models import Loop
from services.db.queries import tasks as task_queries
from services.db.queries.cycles import current_open_cycle
from services.db.queries.traces import count_uncurated_traces
from services.loop.policies import TriggerPolicy
from services.loop.states import LoopLifecycle


class WorkflowState(enum.StrEnum):
    """Where the loop's workflow stands, as far as the caller knows."""

    UNKNOWN = "unknown"  # not asked (the dashboard reads Postgres only)
    NOT_RUNNING = "not_running"
    PAUSED = "paused"
    IN_CYCLE = "in_cycle"
    WAITING = "waiting"


@dataclass(frozen=True)
class WorkflowClock:
    """The loop workflow's state and, while it waits, when its next trigger check (which
    curates first) is due."""

    state: WorkflowState = WorkflowState.UNKNOWN
    next_check_at: dt.datetime | None = None
    cycle: int | None = None


@dataclass(frozen=True)
class NextCycle:
    """The counts a cycle's start and its snapshot depend on, read from Postgres."""

    loop: str
    paused: bool
    has_champion: bool
    new_train_tasks: int
    min_new_tasks: int
    eval_tasks: int
    pending_traces: int
    check_interval_s: float

    def waits_for(self) -> list[str]:
        """What the next cycle lacks, one line each with what to do; empty when a trigger
        check would start one that can train."""
        missing: list[str] = []
        if self.paused:
            missing.append(f"the loop is paused: `ratchet loop resume {self.loop}`")
        if self.new_train_tasks < self.min_new_tasks:
            missing.append(
                f"{self.new_train_tasks} of {self.min_new_tasks} new train tasks "
                "(trigger_policy.min_new_tasks)"
            )
        if self.eval_tasks == 0:
            missing.append(
                "no eval tasks yet (a cycle's snapshot needs one; curation holds out a share "
                "of the failure clusters for eval: curation_policy.eval_fraction)"
            )
        if not self.has_champion:
            missing.append(no_champion_message(self.loop))
        return missing

    def summary(self) -> str:
        """One line: what the next cycle waits for, or that nothing holds it back."""
        missing = self.waits_for()
        if missing:
            return "; ".join(missing)
        return "nothing: the next trigger check starts a cycle"

    def curation_note(self, clock: WorkflowClock, *, now: dt.datetime) -> str | None:
        """When the traces not curated yet will be (None: there are none)."""
        if self.pending_traces == 0:
            return None
        one = self.pending_traces == 1
        waiting = f"{self.pending_traces} {'trace waits' if one else 'traces wait'} for curation"
        every = f"every {self.check_interval_s:g} s while the loop waits"
        if clock.state == WorkflowState.NOT_RUNNING:
            return (
                f"{waiting}: the loop's workflow is not running (`ratchet loop start {self.loop}`)"
            )
        if clock.state == WorkflowState.PAUSED or self.paused:
            return f"{waiting}: curation runs again when the loop resumes"
        if clock.state == WorkflowState.IN_CYCLE:
            return f"{waiting}: curated at the first trigger check after cycle {clock.cycle} ends"
        if clock.state == WorkflowState.WAITING and clock.next_check_at is not None:
            seconds = max(0, round((clock.next_check_at - now).total_seconds()))
            return (
                f"{waiting}: next curation at {clock.next_check_at:%H:%M:%S} UTC "
                f"(in {seconds} s; {every})"
            )
        return f"{waiting}: curated at the loop's next trigger check ({every})"


def run_now_refusal(next_cycle: NextCycle) -> str | None:
    """Why an operator's run-now cannot give a cycle that trains (None: it can): with no
    champion it could only fail (or end ``no_data`` before it noticed)."""
    if next_cycle.has_champion:
        return None
    return f"loop {next_cycle.loop!r} cannot run a cycle: {no_champion_message(next_cycle.loop)}"


def run_now_note(next_cycle: NextCycle) -> str | None:
    """What a run-now's cycle will likely lack (None: nothing known): with no eval task, its
    snapshot ends it ``no_data`` unless curating the pending traces adds one."""
    if next_cycle.eval_tasks > 0:
        return None
    unless = (
        f" unless curating the {next_cycle.pending_traces} pending traces adds one"
        if next_cycle.pending_traces
        else ""
    )
    return f"no eval tasks yet: the cycle ends no_data{unless}"


def no_champion_message(loop: str) -> str:
    """Why a loop with no champion cannot train, and the two ways to give it one."""
    return (
        f"no champion: run `ratchet loop bootstrap {loop}` (a first one from the loop's "
        f"successful traces) or import one: `ratchet models smollm2 --import --loop {loop}`, "
        f"`ratchet models import DIR --loop {loop}`"
    )


def read_next_cycle(*, session: Session, loop: Loop) -> NextCycle:
    """The loop's counts as its next trigger check will see them (read-only)."""
    try:
        trigger = TriggerPolicy.model_validate(loop.trigger_policy or {})
    except ValidationError:
        trigger = TriggerPolicy()  # the loop's own check reports the broken policy
    try:
        difficulty_filter = CurationPolicy.from_json(loop.curation_policy).difficulty_filter
    except CurationPolicyError:
        difficulty_filter = False
    return NextCycle(
        loop=loop.name,
        paused=loop.status == LoopLifecycle.PAUSED,
        has_champion=loop.champion_checkpoint_id is not None,
        new_train_tasks=task_queries.count_new_train_tasks(
            session=session, loop_id=loop.id, difficulty_filter=difficulty_filter
        ),
        min_new_tasks=trigger.min_new_tasks,
        eval_tasks=task_queries.count_eval_tasks(session=session, loop_id=loop.id),
        pending_traces=count_uncurated_traces(session=session, loop_id=loop.id),
        check_interval_s=trigger.check_interval_s,
    )


def database_clock(*, session: Session, loop: Loop) -> WorkflowClock:
    """What Postgres alone tells of the loop's workflow: a cycle open, the loop paused, or
    not known (the api's status route asks the workflow itself)."""
    cycle = current_open_cycle(session=session, loop=loop)
    if cycle is not None:
        return WorkflowClock(WorkflowState.IN_CYCLE, cycle=cycle.number)
    if loop.status == LoopLifecycle.PAUSED:
        return WorkflowClock(WorkflowState.PAUSED)
    return WorkflowClock()
