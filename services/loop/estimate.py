"""Where a cycle's money goes, and what the next one will cost before it trains.

**Costs by phase.** Train and eval jobs report the seconds they spent per phase in
``metrics.json`` (``services.training.phases``). A run's cost and compute-seconds are split
over its phases in proportion to those seconds over the run's wall time; what the job did
not attribute (starting, imports, reading its dataset, a trainer that reports no phases)
is ``other``, so a cycle's phases add up to its cost exactly. An eval job that reports no
phases is all ``evaluation``.

**The estimate.** Each phase has a rate in compute-seconds and in dollars per unit of the
work it scales with: ``rollout`` and ``scoring`` per training episode, ``update`` per
training step, ``evaluation`` per eval sample (a task's sample of one checkpoint), ``sync``
and ``other`` per job. The rates are measured from the runs of the loop's last
:data:`RATE_CYCLES` accounted cycles (sums over sums, so a big run weighs more than a small
one); a phase never measured yet uses :data:`DEFAULT_COMPUTE_S_PER_UNIT`, priced at the
configured accelerator-hour price for a job that holds accelerators and the CPU-hour price
otherwise. The planned work is the training profile's steps (episodes = steps x
tasks_per_step x group_size for GRPO; SFT rolls nothing out) and the snapshot's eval tasks
x ``eval_samples`` x two checkpoints. The estimate is the sum of units x dollars per unit;
the loop refuses a cycle whose estimate exceeds what is left of its budget.

**Calibration.** A loop with no measured cycle has no rates of its own, and the defaults
missed its first cycle by x52 on the toy demo and by x6.5 the other way on SmolLM2. So the
first cycle runs a calibration pass first (services.training.calibration: its own train
job, shortened to a couple of steps on one rollout batch, on its executor) and the estimate
prices the train phases at that run's rates (:func:`calibrated_rates`), and evaluation at
its rollout rate per episode (an eval sample is an episode of the same model through the
same engine). Where the pass failed or could not run, the defaults stand and the estimate
says it is not calibrated.

**Its uncertainty.** Every estimate carries a range (``low_usd``, ``high_usd``): a phase
measured over earlier cycles spans the lowest and highest rate of the runs it was measured
on; a calibrated phase spans :data:`CALIBRATED_SPREAD` of its rate either way (one short
pass: warm-up and a partly filled batch make it high, later rounds' longer episodes low; the
width is chosen, not yet measured); a default spans :data:`DEFAULT_SPREAD` (the misses
above). A refusal says which it rests on.

The measured dollar rates carry the loop's accelerators and prices as they were; after a
change of either, the first cycle's estimate is off by that change, and the next is
measured again. Judge calls (LLM judges of replay tasks) are counted in the actual cost of
the run that made them, and in its phases, like its compute.

Free of the database and of Temporal: the estimate activity reads the rows and calls this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from services.loop.policies import TrainingProfile
from services.training.config import GRPOConfig, RFTConfig, SamplingOptions, parse_chain

PHASES = ("rollout", "scoring", "update", "sync", "evaluation", "other")
# The unit each phase's rate is per.
PHASE_UNITS = {
    "rollout": "episode",
    "scoring": "episode",
    "update": "step",
    "evaluation": "eval_sample",
    "sync": "job",
    "other": "job",
}
# Compute-seconds per unit before a loop has measured its own, deliberately on the high
# side of the tiny family on a laptop CPU (measured there at about a third of these), so a
# first cycle is refused rather than overspent when the budget is tight.
DEFAULT_COMPUTE_S_PER_UNIT = {
    "rollout": 1.0,
    "scoring": 0.1,
    "update": 2.0,
    "evaluation": 0.5,
    "sync": 5.0,
    "other": 10.0,
}
# How far from its rate a phase's cost may lie, as (low, high) factors: a calibrated rate
# (one short pass) and a default one (never measured: off by x52 and x6.5 so far).
CALIBRATED_SPREAD = (0.5, 2.0)
DEFAULT_SPREAD = (0.01, 10.0)
# How many of the loop's last accounted cycles the rates are measured over.
RATE_CYCLES = 5
# Each checkpoint evaluated per cycle: the champion and the candidate.
EVAL_TARGETS = 2
_ROUND = 6


@dataclass(frozen=True)
class PhaseCost:
    """What one phase of a run (or of a cycle) took: wall seconds, compute-seconds, dollars."""

    seconds: float = 0.0
    compute_s: float = 0.0
    cost_usd: float = 0.0

    def __add__(self, other: PhaseCost) -> PhaseCost:
        return PhaseCost(
            self.seconds + other.seconds,
            self.compute_s + other.compute_s,
            self.cost_usd + other.cost_usd,
        )

    def rounded(self) -> dict[str, float]:
        return {key: round(value, _ROUND) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class RunRecord:
    """A finished run as the ledger holds it: what the phase split and the rates read."""

    kind: str  # "train" | "eval" | "probe"
    metrics: Mapping[str, Any]
    wall_s: float
    compute_s: float
    cost_usd: float


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0.0
    return max(0.0, float(value))


def reported_seconds(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The job's ``phases`` seconds (known phases only; anything malformed counts as 0)."""
    phases = metrics.get("phases")
    if not isinstance(phases, Mapping):
        return {}
    seconds: dict[str, float] = {}
    for name, value in phases.items():
        if name in PHASES and name != "other" and isinstance(value, Mapping):
            seconds[name] = _number(value.get("seconds"))
    return seconds


def run_phase_costs(run: RunRecord) -> dict[str, PhaseCost]:
    """The run's cost and compute split over its phases (they add up to the run's), in
    :data:`PHASES` order."""
    seconds = reported_seconds(run.metrics)
    if not seconds and run.kind in ("eval", "probe"):
        seconds = {"evaluation": max(run.wall_s, 0.0)}
    total_s = max(run.wall_s, sum(seconds.values()))
    costs: dict[str, PhaseCost] = {}
    for name, phase_s in seconds.items():
        share = phase_s / total_s if total_s > 0 else 0.0
        costs[name] = PhaseCost(phase_s, run.compute_s * share, run.cost_usd * share)
    attributed = sum(costs.values(), PhaseCost())
    rest = PhaseCost(
        max(0.0, total_s - attributed.seconds),
        max(0.0, run.compute_s - attributed.compute_s),
        max(0.0, run.cost_usd - attributed.cost_usd),
    )
    if rest.seconds or rest.compute_s or rest.cost_usd or not costs:
        costs["other"] = rest
    return {name: costs[name] for name in PHASES if name in costs}


def cycle_phase_costs(runs: Iterable[RunRecord]) -> dict[str, dict[str, float]]:
    """``cycles.cost_by_phase``: the phases of every run of the cycle, summed, in order."""
    totals: dict[str, PhaseCost] = {}
    for run in runs:
        for name, cost in run_phase_costs(run).items():
            totals[name] = totals.get(name, PhaseCost()) + cost
    return {name: totals[name].rounded() for name in PHASES if name in totals}


@dataclass(frozen=True)
class Units:
    """Work in the units the rates are per."""

    episode: float = 0.0
    step: float = 0.0
    eval_sample: float = 0.0
    job: float = 0.0

    def of(self, phase: str) -> float:
        return float(getattr(self, PHASE_UNITS[phase]))


def run_units(run: RunRecord) -> Units:
    """The work a finished run did, from its metrics (steps and episodes of a train job,
    tasks x samples of an eval job; a calibration pass is a short train job)."""
    if run.kind in ("train", "calibrate"):
        return Units(
            episode=_number(run.metrics.get("episodes")),
            step=_number(run.metrics.get("steps")),
            job=1.0,
        )
    samples = _number(run.metrics.get("samples")) or 1.0
    return Units(eval_sample=_number(run.metrics.get("n")) * samples, job=1.0)


Basis = Literal["measured", "calibrated", "default"]


@dataclass(frozen=True)
class Rate:
    """One phase's cost per unit of its work, where it comes from (measured over earlier
    cycles, calibrated by a short pass, or the default) and the dollars per unit it may lie
    between (``usd_low``, ``usd_high``)."""

    unit: str
    compute_s: float
    usd: float
    measured: bool
    basis: Basis = "measured"
    usd_low: float | None = None
    usd_high: float | None = None

    @property
    def usd_range(self) -> tuple[float, float]:
        low = self.usd if self.usd_low is None else self.usd_low
        return low, self.usd if self.usd_high is None else self.usd_high


def measured_rates(runs: Iterable[RunRecord]) -> dict[str, Rate]:
    """Per-phase rates over ``runs`` (succeeded runs of earlier cycles; sums over sums) with
    the range of the runs' own rates; a phase whose unit they never did is left out."""
    cost: dict[str, PhaseCost] = {}
    units: dict[str, float] = {}
    each: dict[str, list[float]] = {}
    for run in runs:
        if run.kind == "calibrate":  # a pass's warm-up is not a cycle's rate
            continue
        done = run_units(run)
        for name, phase in run_phase_costs(run).items():
            cost[name] = cost.get(name, PhaseCost()) + phase
            if done.of(name) > 0:
                each.setdefault(name, []).append(phase.cost_usd / done.of(name))
        for name in PHASES:
            units[name] = units.get(name, 0.0) + done.of(name)
    return {
        name: Rate(
            PHASE_UNITS[name],
            cost[name].compute_s / units[name],
            cost[name].cost_usd / units[name],
            measured=True,
            usd_low=min(each.get(name) or [cost[name].cost_usd / units[name]]),
            usd_high=max(each.get(name) or [cost[name].cost_usd / units[name]]),
        )
        for name in PHASES
        if name in cost and units.get(name, 0.0) > 0
    }


def calibrated_rates(calibration: RunRecord) -> dict[str, Rate]:
    """The rates a calibration pass measured (services.training.calibration), each spanning
    :data:`CALIBRATED_SPREAD`: its train phases as measured, and ``evaluation`` at its
    rollout (and scoring) cost per episode, since an eval sample is an episode of the same
    model through the same engine. Empty when the pass did no work to measure."""
    done = run_units(calibration)
    low, high = CALIBRATED_SPREAD
    rates: dict[str, Rate] = {}
    for name, phase in run_phase_costs(calibration).items():
        amount = done.of(name)
        if amount > 0:
            rates[name] = _spread(
                Rate(PHASE_UNITS[name], phase.compute_s / amount, phase.cost_usd / amount, False),
                low,
                high,
            )
    episode = [rates[n] for n in ("rollout", "scoring") if n in rates]
    if episode:
        rates["evaluation"] = _spread(
            Rate(
                PHASE_UNITS["evaluation"],
                sum(r.compute_s for r in episode),
                sum(r.usd for r in episode),
                False,
            ),
            low,
            high,
        )
    return rates


def _spread(rate: Rate, low: float, high: float, basis: Basis = "calibrated") -> Rate:
    return replace(rate, basis=basis, usd_low=rate.usd * low, usd_high=rate.usd * high)


@dataclass(frozen=True)
class Prices:
    """The configured prices (``RATCHET_ACCELERATOR_HOUR_PRICE_USD``, ``..._CPU_HOUR_...``)."""

    accelerator_hour_usd: float
    cpu_hour_usd: float

    def per_compute_s(self, accelerators: int) -> float:
        """Dollars per compute-second of a job holding ``accelerators`` (0: CPU seconds)."""
        return (self.accelerator_hour_usd if accelerators > 0 else self.cpu_hour_usd) / 3600.0


def default_rates(profile: TrainingProfile, prices: Prices) -> dict[str, Rate]:
    """:data:`DEFAULT_COMPUTE_S_PER_UNIT` priced for the profile's jobs: training phases at
    the train job's accelerators, ``evaluation`` at the eval job's, ``sync`` and ``other``
    at the dearer of the two (they happen in both)."""
    train = prices.per_compute_s(profile.nodes * profile.accelerators)
    evaluation = prices.per_compute_s(profile.eval_accelerators)
    price = {
        "rollout": train,
        "scoring": train,
        "update": train,
        "evaluation": evaluation,
        "sync": max(train, evaluation),
        "other": max(train, evaluation),
    }
    low, high = DEFAULT_SPREAD
    return {
        name: _spread(
            Rate(
                PHASE_UNITS[name],
                DEFAULT_COMPUTE_S_PER_UNIT[name],
                DEFAULT_COMPUTE_S_PER_UNIT[name] * price[name],
                measured=False,
            ),
            low,
            high,
            basis="default",
        )
        for name in PHASES
    }


@dataclass(frozen=True)
class PlannedWork:
    """What a cycle is about to run: the trainer's steps and episodes, the eval samples of
    both checkpoints on every task set, and the number of jobs."""

    steps: int
    episodes: int
    eval_tasks: int
    eval_samples: int
    jobs: int

    @property
    def units(self) -> Units:
        return Units(
            episode=self.episodes, step=self.steps, eval_sample=self.eval_samples, job=self.jobs
        )


def planned_work(
    profile: TrainingProfile,
    *,
    eval_task_counts: Iterable[int],
    samples_per_task: int,
    train_tasks: int = 0,
    replay_tasks: int = 0,
) -> PlannedWork:
    """The work of a cycle with this training profile (every stage of a chain) and these
    eval task sets (their sizes; an empty set runs no job): a GRPO stage samples
    ``steps x tasks_per_step x group_size`` episodes, an rft or dpo stage
    ``samples_per_task`` per train task (per iteration), and rft's replay its
    ``replay_samples_per_task`` of each of at most ``replay_tasks`` of the dataset's
    ``replay_tasks``. The profile was
    checked when the loop was saved."""
    stages = parse_chain(profile.family, profile.algorithm, profile.hyperparameters)
    steps = episodes = 0
    for hyper in stages:
        config = hyper.config
        steps += int(config.steps)
        if isinstance(config, GRPOConfig):
            episodes += config.steps * config.tasks_per_step * config.group_size
        elif isinstance(config, SamplingOptions):
            rounds = int(getattr(config, "iterations", 1))
            episodes += rounds * config.samples_per_task * max(0, train_tasks)
        if isinstance(config, RFTConfig) and config.replay_fraction > 0:
            replayed = min(config.replay_tasks, max(0, replay_tasks))
            episodes += config.replay_samples_per_task * replayed
    sets = [int(count) for count in eval_task_counts if count > 0]
    eval_tasks = sum(sets)
    return PlannedWork(
        steps=steps,
        episodes=episodes,
        eval_tasks=eval_tasks,
        eval_samples=eval_tasks * samples_per_task * EVAL_TARGETS,
        jobs=1 + EVAL_TARGETS * len(sets),
    )


@dataclass(frozen=True)
class Estimate:
    """A cycle's expected cost, phase by phase, with its range and what its rates rest on,
    and whether it fits what the budget has left."""

    usd: float
    compute_s: float
    phases: dict[str, dict[str, float]]
    planned: dict[str, int]
    rates: dict[str, dict[str, Any]]
    budget_usd: float | None
    left_usd: float | None
    measured_cycles: int
    reason: str = ""
    fits: bool = True
    low_usd: float = 0.0
    high_usd: float = 0.0
    basis: str = ""  # what the rates rest on, in words (see :func:`basis_of`)
    calibrated: bool = False  # no phase priced at a default rate

    def to_json(self) -> dict[str, Any]:
        """What ``cycles.estimate`` stores (the dollars are also ``cycles.estimate_usd``)."""
        return {
            "usd": self.usd,
            "low_usd": self.low_usd,
            "high_usd": self.high_usd,
            "basis": self.basis,
            "calibrated": self.calibrated,
            "compute_s": self.compute_s,
            "phases": self.phases,
            "planned": self.planned,
            "rates": self.rates,
            "budget_usd": self.budget_usd,
            "left_usd": self.left_usd,
            "measured_cycles": self.measured_cycles,
            "fits": self.fits,
            "reason": self.reason,
        }


def basis_of(rates: Mapping[str, Rate], measured_cycles: int, calibration: str | None) -> str:
    """In words, what the priced phases' rates rest on: the measured cycles, the calibration
    pass (``calibration`` names it), or the defaults, which are not a measurement. Where some
    phases are measured and others priced at defaults, the defaults are named by phase: "NOT
    calibrated" is said only of an estimate that measured nothing (a calibrated estimate that
    also said it read as a contradiction)."""
    defaulted = sorted(phase for phase, rate in rates.items() if rate.basis == "default")
    kinds = {rate.basis for rate in rates.values()}
    parts = []
    if "measured" in kinds:
        parts.append(f"measured over {measured_cycles} cycle(s)")
    if "calibrated" in kinds:
        parts.append(f"calibrated by {calibration or 'a short pass'}")
    if defaulted and parts:
        parts.append(f"{', '.join(defaulted)} at default rates, not measured for this loop")
    elif defaulted:
        why = f" (the calibration pass, {calibration}, measured nothing)" if calibration else ""
        parts.append(
            f"NOT calibrated{why}: default rates, not a measurement of this loop (they have "
            "missed by x52 and x6.5)"
        )
    return "; ".join(parts)


def estimate_cycle(
    work: PlannedWork,
    *,
    measured: Mapping[str, Rate],
    defaults: Mapping[str, Rate],
    measured_cycles: int,
    budget_usd: float | None,
    spent_usd: float,
    calibrated: Mapping[str, Rate] | None = None,
    calibration: str | None = None,
) -> Estimate:
    """Units x rate per phase (measured where the loop has measured it, else calibrated by
    the cycle's calibration pass ``calibration``, else the default), its range, and the
    verdict: a cycle fits when the loop has no budget or its estimate is at most what is
    left."""
    units = work.units
    phases: dict[str, dict[str, float]] = {}
    rates: dict[str, dict[str, Any]] = {}
    used: dict[str, Rate] = {}
    low = high = 0.0
    for name in PHASES:
        rate = measured.get(name) or (calibrated or {}).get(name) or defaults[name]
        amount = units.of(name)
        rate_low, rate_high = rate.usd_range
        rates[name] = {
            "unit": rate.unit,
            "compute_s": round(rate.compute_s, _ROUND),
            "usd": round(rate.usd, 9),
            "usd_range": [round(rate_low, 9), round(rate_high, 9)],
            "measured": rate.measured,
            "basis": rate.basis,
        }
        if amount > 0:
            used[name] = rate
            low, high = low + amount * rate_low, high + amount * rate_high
            phases[name] = {
                "units": amount,
                "compute_s": round(amount * rate.compute_s, _ROUND),
                "cost_usd": round(amount * rate.usd, _ROUND),
            }
    usd = round(sum(p["cost_usd"] for p in phases.values()), _ROUND)
    compute_s = round(sum(p["compute_s"] for p in phases.values()), _ROUND)
    basis = basis_of(used, measured_cycles, calibration)
    left = None if budget_usd is None else round(budget_usd - spent_usd, _ROUND)
    fits = left is None or usd <= left
    reason = ""
    if not fits:
        assert budget_usd is not None and left is not None
        reason = (
            f"estimated ${usd:.4f} (range ${low:.4f} to ${high:.4f}; {basis}) for "
            f"{work.steps} steps, {work.episodes} episodes and {work.eval_samples} eval "
            f"samples exceeds the ${max(left, 0.0):.4f} left of the loop's ${budget_usd:.2f} "
            "budget; raise the budget or plan less work, then resume"
        )
    return Estimate(
        usd=usd,
        compute_s=compute_s,
        phases=phases,
        planned=asdict(work),
        rates=rates,
        budget_usd=budget_usd,
        left_usd=left,
        measured_cycles=measured_cycles,
        reason=reason,
        fits=fits,
        low_usd=round(low, _ROUND),
        high_usd=round(high, _ROUND),
        basis=basis,
        calibrated=all(rate.basis != "default" for rate in used.values()),
    )
