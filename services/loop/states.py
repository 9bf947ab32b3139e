"""The words the loop's rows and workflows record, one ``StrEnum`` each.

A cycle's stage and outcome, a run's status, a loop's lifecycle status, a promotion's
decision and status are stored as text (``cycles.stage``, ``runs.status``, ...) and carried
as text in workflow histories. Each is a ``StrEnum`` here, so code names a member instead of
repeating a string, and a typo fails the type checker instead of a check constraint. A member
*is* its string (``CycleOutcome.PROMOTED == "promoted"``), so stored values, payloads and
committed histories are unchanged. Where the database has a check constraint on the column
(services/db/models.py), it lists the same values; tests/services/loop/test_states.py keeps
the two in step.
"""

from __future__ import annotations

import enum


class CycleStage(enum.StrEnum):
    """Where a loop stands: the stages of a cycle in the order they run, and the loop's
    stages between cycles (``starting``, ``waiting``, ``paused``, ``awaiting_approval`` for
    the manual gate, ``rollback`` for an operator's). ``cycles.stage`` holds the former, and
    ``done`` once the cycle is closed; the ``RatchetStage`` search attribute and the status
    query show the stages of both kinds."""

    STARTING = "starting"
    WAITING = "waiting"
    PAUSED = "paused"
    CURATE = "curate"
    ESTIMATE = "estimate"
    PROBE = "probe"
    SNAPSHOT = "snapshot"
    DEMONSTRATIONS = "demonstrations"  # a bootstrap's (workflows/bootstrap.py)
    TRAIN = "train"
    EVALUATE = "evaluate"
    GATE = "gate"
    AWAITING_APPROVAL = "awaiting_approval"
    PROMOTE = "promote"
    ACCOUNT = "account"
    DONE = "done"
    ROLLBACK = "rollback"


# The trigger a bootstrap cycle records (``cycles.trigger``; workflows/bootstrap.py): its
# snapshot holds the loop's train tasks, yet it trains on successes, never on them.
BOOTSTRAP_TRIGGER = "bootstrap"


class CycleOutcome(enum.StrEnum):
    """How a cycle ended (``cycles.outcome``)."""

    PROMOTED = "promoted"
    REJECTED = "rejected"
    ROLLED_BACK = "rolled_back"
    NO_DATA = "no_data"
    OVER_BUDGET = "over_budget"
    FAILED = "failed"


class RunStatus(enum.StrEnum):
    """Where a run (one job on an executor) stands (``runs.status``); the executors' job
    states are the same words."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        """Whether the run has ended: nothing about it changes any more."""
        return self not in (RunStatus.PENDING, RunStatus.RUNNING)


class LoopLifecycle(enum.StrEnum):
    """A loop's status (``loops.status``): ``active`` runs cycles, ``paused`` waits for an
    operator (or a raised budget), ``archived`` is kept for its history only. (Named apart
    from ``workflows.payloads.loop.LoopStatus``, the workflow's status query.)"""

    ACTIVE = "active"
    PAUSED = "paused"
    ARCHIVED = "archived"


class Decision(enum.StrEnum):
    """What a promotion row decided (``promotions.decision``)."""

    PROMOTE = "promote"
    REJECT = "reject"
    ROLLBACK = "rollback"


class PromotionStatus(enum.StrEnum):
    """What followed a decision (``promotions.status``): a promotion is ``decided``, then
    ``deploying``, in its ``canary``, and ``held`` or ``rolled_back``; a rejection is
    ``rejected``; a deploy or rollback that did not happen is ``failed``."""

    DECIDED = "decided"
    DEPLOYING = "deploying"
    CANARY = "canary"
    HELD = "held"
    ROLLED_BACK = "rolled_back"
    REJECTED = "rejected"
    FAILED = "failed"


class ProbeStatus(enum.StrEnum):
    """How a cycle's difficulty probe ended (``ProbeResult.status``): ``skipped`` when every
    train task was already probed and no job ran, else its job's end (a run's terminal
    words). The loop goes on either way; it warns of the others."""

    SKIPPED = "skipped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def clean(self) -> bool:
        """Whether the probe left nothing to warn about: its job succeeded, or it had no
        task to probe."""
        return self in (ProbeStatus.SUCCEEDED, ProbeStatus.SKIPPED)
