"""Seconds per phase of a job, for ``metrics.json``: where a run's compute (and money) went.

The phases are the ones the loop's ledger prices (DESIGN §8): ``rollout`` (generating
episodes), ``scoring`` (rewards, advantages, reference and old log-probs), ``update``
(forward, backward, gradient sync and the optimizer step), ``sync`` (moving weights: loading
the base checkpoint, saving resume points and the output checkpoint) and ``evaluation``
(an eval job's rollouts and verification). What a job does outside them (imports, reading
its dataset, building demonstrations) is left unattributed; the worker books the rest of
the run's wall time as ``other``.

A job reports ``{"phases": {name: {"seconds": s, "compute_s": s * world_size}}}``:
``seconds`` is rank 0's wall time in the phase, ``compute_s`` the process-seconds all ranks
spent in it. On CUDA the clock synchronizes the device at each phase boundary, so a phase is
charged for its kernels rather than for launching them (the boundaries are few per step,
and the steps already wait on the device to read their losses).

Torch and the standard library only: this runs inside the job image.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

import torch

PHASES = ("rollout", "scoring", "update", "sync", "evaluation")


class PhaseClock:
    """Adds the wall seconds of each ``with clock.phase(name)`` block to ``seconds``.

    ``seconds`` may be a dict the caller keeps (a trainer's resume-point counters), so a
    resumed run keeps counting from where the killed one stopped.
    """

    def __init__(
        self,
        device: torch.device | None = None,
        seconds: MutableMapping[str, float] | None = None,
    ) -> None:
        self.device = device
        self.seconds: MutableMapping[str, float] = seconds if seconds is not None else {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r} (expected one of {', '.join(PHASES)})")
        self._synchronize()
        started = time.monotonic()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + (time.monotonic() - started)

    def _synchronize(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def phase_report(
    *clocks: PhaseClock | MutableMapping[str, float], world_size: int = 1
) -> dict[str, dict[str, float]]:
    """The ``metrics.json`` ``phases`` object: the clocks' seconds summed per phase, and
    the compute (process-seconds over ``world_size`` ranks) they stand for."""
    totals: dict[str, float] = {}
    for clock in clocks:
        seconds = clock.seconds if isinstance(clock, PhaseClock) else clock
        for name, value in seconds.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return {
        name: {
            "seconds": round(totals[name], 4),
            "compute_s": round(totals[name] * max(1, world_size), 4),
        }
        for name in PHASES
        if name in totals
    }
