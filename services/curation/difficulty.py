"""The difficulty filter: train only on tasks the champion sometimes solves.

GRPO learns from the spread of rewards inside a group of rollouts of one task. A task the
champion always solves (pass rate 1) or never solves (pass rate 0) gives every rollout the
same reward, a zero advantage and no gradient, so it only costs compute. The loop runs the
champion ``probe_attempts`` times per task (a ``probe`` run: an eval job with ``samples``
set to the attempts) and records the pass rates; this module reads the job's per-task counts
(:func:`probe_counts`) and decides from them alone. Tasks never probed are kept: no evidence
is not evidence of zero variance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProbeCount:
    """How many of ``attempts`` probe rollouts of a task passed."""

    passed: int
    attempts: int

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a probe needs at least one attempt, got {self.attempts}")
        if not 0 <= self.passed <= self.attempts:
            raise ValueError(f"passed must be between 0 and {self.attempts}, got {self.passed}")

    @property
    def pass_rate(self) -> float:
        return self.passed / self.attempts


@dataclass(frozen=True)
class DifficultySelection:
    """The outcome of the filter, with the counts a dataset records."""

    kept: frozenset[int]
    too_easy: frozenset[int] = field(default_factory=frozenset)
    too_hard: frozenset[int] = field(default_factory=frozenset)
    unprobed: frozenset[int] = field(default_factory=frozenset)

    def counts(self) -> dict[str, int]:
        return {
            "kept": len(self.kept),
            "too_easy": len(self.too_easy),
            "too_hard": len(self.too_hard),
            "unprobed": len(self.unprobed),
        }


def select_by_difficulty(probes: Mapping[int, ProbeCount | float | None]) -> DifficultySelection:
    """Keep tasks whose pass rate is strictly between 0 and 1, or that were never probed.

    ``probes`` maps task ids to their probe counts, or to the pass rate recorded on the task
    (``tasks.probe_pass_rate``), or to ``None`` when the task was not probed.
    """
    kept: set[int] = set()
    easy: set[int] = set()
    hard: set[int] = set()
    unprobed: set[int] = set()
    for task_id, probe in probes.items():
        rate = probe.pass_rate if isinstance(probe, ProbeCount) else probe
        if rate is None:
            unprobed.add(task_id)
            kept.add(task_id)
        elif not 0.0 <= rate <= 1.0:
            raise ValueError(f"task {task_id} has pass rate {rate}, outside [0, 1]")
        elif rate >= 1.0:
            easy.add(task_id)
        elif rate <= 0.0:
            hard.add(task_id)
        else:
            kept.add(task_id)
    return DifficultySelection(
        kept=frozenset(kept),
        too_easy=frozenset(easy),
        too_hard=frozenset(hard),
        unprobed=frozenset(unprobed),
    )


def probe_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, ProbeCount]:
    """Per-task counts from the rows of a probe's ``results.jsonl``, keyed by task id.

    Each row of the eval job names its task by its task id (``task_id``) and reports
    ``samples`` rollouts of which ``sample_passes`` passed. A row without them, or a task
    named twice, raises ``ValueError`` naming the row.
    """
    counts: dict[str, ProbeCount] = {}
    for number, row in enumerate(rows, start=1):
        task_id, samples, passes = row.get("task_id"), row.get("samples"), row.get("sample_passes")
        if not isinstance(task_id, str) or not task_id:
            raise ValueError(f"result {number} has no task_id")
        if (
            not isinstance(samples, int)
            or not isinstance(passes, int)
            or isinstance(samples, bool)
            or isinstance(passes, bool)
        ):
            raise ValueError(f"result {number} (task {task_id[:12]}) has no sample counts")
        if task_id in counts:
            raise ValueError(f"result {number}: task {task_id[:12]} is reported twice")
        counts[task_id] = ProbeCount(passed=passes, attempts=samples)
    return counts
