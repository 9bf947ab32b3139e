"""What a training run did: the totals every trainer keeps and reports in ``metrics.json``.

One class for the tiny and hf families, GRPO and SFT alike, so a figure (tokens per second,
filtered groups) means the same in every job's metrics; the tiny GRPO trainer also carries
it through resume points (``to_dict``/``from_dict``), so a resumed run keeps counting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from services.inference.utilisation import Utilisation


@dataclass
class RunCounters:
    """Running totals of one training run (an SFT run leaves the rollout fields at zero)."""

    steps_done: int = 0
    train_tokens: int = 0
    train_s: float = 0.0
    rollout_tokens: int = 0
    rollout_s: float = 0.0
    episodes: int = 0
    groups: int = 0
    filtered_zero_variance_groups: int = 0
    final_loss: float | None = None
    # Wall seconds per phase (services.training.phases), kept through resume points.
    phase_s: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    # FLOPs needed against the measured peak, per pass (services.inference.utilisation)
    utilisation: Utilisation = field(default_factory=Utilisation)

    def add_sampling(self, generated_tokens: int, wall_s: float, episodes: int) -> None:
        """A round of sampled episodes (rft's, dpo's, rft's replay): their cost counts in
        the rollout figures and the rollout phase, whatever the episodes are then used for."""
        self.rollout_tokens += generated_tokens
        self.rollout_s += wall_s
        self.episodes += episodes
        self.add_phases({"rollout": wall_s})

    def add_phases(self, seconds: dict[str, float]) -> None:
        """Seconds spent per phase (:mod:`services.training.phases`) by a part of the run,
        e.g. an SFT run inside rft, added to the run's own."""
        for name, value in seconds.items():
            self.phase_s[name] = self.phase_s.get(name, 0.0) + value

    @property
    def train_tokens_per_s(self) -> float:
        return round(self.train_tokens / self.train_s, 1) if self.train_s else 0.0

    @property
    def rollout_tokens_per_s(self) -> float:
        return round(self.rollout_tokens / self.rollout_s, 1) if self.rollout_s else 0.0

    def metrics(self) -> dict[str, Any]:
        """The figures every GRPO job writes to metrics.json (a trainer adds its own)."""
        return {
            "steps": self.steps_done,
            "train_tokens": self.train_tokens,
            "rollout_tokens": self.rollout_tokens,
            "train_tokens_per_s": self.train_tokens_per_s,
            "rollout_tokens_per_s": self.rollout_tokens_per_s,
            "episodes": self.episodes,
            "groups": self.groups,
            "filtered_zero_variance_groups": self.filtered_zero_variance_groups,
            "history": self.history,
            **self.utilisation.report(),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunCounters:
        """Counters saved by any version: keys this one does not know are dropped."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["utilisation"] = Utilisation.from_dict(known.get("utilisation") or {})
        return cls(**known)
