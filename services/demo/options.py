"""What a demo run is asked to do: the knobs of ``ratchet demo`` and benchmarks/loop.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOP_NAME = "demo"

# What differs by champion when the caller does not say (``DemoOptions.for_model``). Renames
# alone (v2) do not hurt a real LM, which reads the function names from the tool list: the
# SFT champion passes ~95% of v2 tasks (docs/models.md). v3's new required ``cur`` argument
# does: it learned the lookup call's shape by heart and drops it. A real LM's episode takes
# the model server seconds, not milliseconds: two simulated users curated ~3 failures a
# minute (36 minutes to 48 tasks, docs/models.md); eight keep its engine's batch full, and
# its decode steps cost little more at 8 rows than at 2. Its cycle is the rft job's hour.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "smollm2": {"drift_to": "v3", "timeout_s": 7200.0, "traffic_workers": 8},
}
# Where the demo's progress lines go: the CLI prints them, a benchmark may collect them.
Printer = Callable[[str], None]


@dataclass
class DemoOptions:
    cycles: int = 1
    drift_at: float = 45.0
    traffic: float = 4.0
    traffic_workers: int = 2  # simulated users at once, each one episode after another
    drift_to: str = "v2"
    state_dir: Path | None = None
    timeout_s: float = 1500.0
    min_new_tasks: int = 48
    canary_seconds: float = 30.0
    # The sampling temperature the simulated agent asks the model server for (0: greedy, as
    # the agents of docs/quickstart.md). The demo's gate evaluates at the same temperature
    # (greedy: one sample per task), so offline figures measure what is served
    # (docs/models.md, "Live against offline").
    traffic_temperature: float = 0.0
    # The demo loop's curation (docs/curation.md): every success curated, so successes and
    # failures enter the held-out set alike and it has the traffic's mix; a held-out share
    # of 0.3 of clusters (the default is 0.1) so that by the first cycle (48 train tasks)
    # it holds about 40 failures and successes beside them, enough for a held-out interval
    # near ±15 points (a gain's paired interval on n tasks is at most about ±100/sqrt(n));
    # the report says when it is wider. Sampled successes on the judged side (eval-hashed
    # clusters) are the regression suite, the others the replay split.
    curation_policy: dict[str, Any] = field(
        default_factory=lambda: {"success_sample_rate": 1.0, "heldout_fraction": 0.3}
    )
    # The settings benchmarks/trainer.py measures (see docs/environments.md), plus a KL
    # penalty to the champion: the demo trains on ~50 curated failures for 40 steps, and
    # without the anchor the candidate forgets a few of the v1 tasks its regression suite
    # pins (6 of 89 in a measured run, more than the gate's tolerance; 0 with kl_coef 0.2).
    grpo_hyperparameters: dict[str, Any] = field(
        default_factory=lambda: {
            "steps": 40,
            "tasks_per_step": 8,
            "group_size": 16,
            "temperature": 1.0,
            "lr": 3e-4,
            "kl_coef": 0.2,
            "max_turns": 4,
            "max_new_tokens": 16,
            "checkpoint_every": 0,
            "log_every": 1,
        }
    )
    sft_hyperparameters: dict[str, Any] = field(
        default_factory=lambda: {
            "steps": 1000,
            "batch_size": 32,
            "lr": 3e-3,
            "warmup": 30,
            "log_every": 100,
            "augment_fraction": 0.3,
        }
    )
    sft_tasks: int = 4000
    champion_cache: Path | None = None
    model: str = "tiny"  # or "smollm2": the real LM (services/demo/smollm2.py)

    @classmethod
    def for_model(cls, model: str, **values: Any) -> DemoOptions:
        """Options for the champion ``model``: its defaults (``MODEL_DEFAULTS``), then what the
        caller set (a value of None is not set)."""
        given = {key: value for key, value in values.items() if value is not None}
        return cls(model=model, **{**MODEL_DEFAULTS[model], **given})
