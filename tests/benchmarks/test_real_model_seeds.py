"""benchmarks/real_model.py --seeds: one line over several seeds' runs, mean and range."""

from __future__ import annotations

from typing import Any

from benchmarks.real_model import aggregate_seeds


def _run(seed: int, after: float, passing: int, rare: str | None) -> dict[str, Any]:
    return {
        "seed": seed,
        "algorithm": "rft",
        "quick": False,
        "v2_pass_before": 0.0,
        "v2_pass_after": after,
        "v2_gain_points": 100 * after,
        "passing_episodes": passing,
        "episodes": 1024,
        "grpo_wall_s": None,  # not measured: left out of the headline
        "rare_successes": rare,
    }


def test_seeds_aggregate_to_mean_range_and_values_in_seed_order() -> None:
    runs = [
        _run(0, 1.0, 2, "round 1: 2 of 1,024 episodes passed"),
        _run(1, 0.375, 1, "round 1: 1 of 1,024 episodes passed"),
        _run(2, 0.5, 40, None),
    ]
    line = aggregate_seeds(runs)
    assert line["benchmark"] == "real_model_seeds" and line["seeds"] == [0, 1, 2]
    assert line["headline"]["v2_pass_after"] == {
        "mean": round((1.0 + 0.375 + 0.5) / 3, 4),
        "min": 0.375,
        "max": 1.0,
        "values": [1.0, 0.375, 0.5],
    }
    assert line["headline"]["passing_episodes"]["values"] == [2, 1, 40]
    assert "grpo_wall_s" not in line["headline"]
    assert set(line["rare_successes"]) == {"0", "1"}
