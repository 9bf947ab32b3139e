"""benchmarks/many_loops.py: its pure parts (quantiles, the trace pool, the refusals of bad
arguments) and a smoke run at tiny sizes on a real stack whose JSON line carries every
figure. The figures themselves come from a quiet machine (docs/deploy.md, "Many loops")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.many_loops import parse_args, quantile, trace_pool
from services.ingest.schema import parse_native

REPO = Path(__file__).resolve().parents[2]


def test_quantiles_pick_the_rank_and_an_empty_list_has_none() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 51
    assert quantile(values, 0.99) == 100
    assert quantile([], 0.5) is None


def test_the_trace_pool_is_valid_traces_a_third_of_them_successes() -> None:
    pool = trace_pool(30)
    parsed = parse_native(json.dumps({"traces": pool}).encode(), max_batch=100)
    assert parsed.rejected == [] and len(parsed.traces) == 30
    assert sum(trace["outcome"]["success"] for trace in pool) == 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--loops", "0"], "--loops must be at least 1"),
        (["--adapters", "3", "--hot", "4"], "--hot cannot exceed --adapters"),
        (["--model-dir", "/nonexistent"], "holds no converted checkpoint"),
    ],
)
def test_bad_arguments_are_refused_with_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_prints_every_figure_last(tmp_path: Path) -> None:
    command = [
        sys.executable, "benchmarks/many_loops.py", "--loops", "2", "--traffic-s", "3",
        "--settle-s", "2", "--idle-s", "6", "--baseline-s", "2", "--concurrency", "2",
        "--check-interval-s", "1", "--idle-check-interval-s", "4", "--pool", "20",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["loops"] == 2 and figures["traces_posted"] > 0
    assert figures["api_failures"] == 0
    for key in (
        "api_p99_ms",
        "curation_fairness",
        "idle_cpu_core_per_loop",
        "idle_mib_per_loop",
        "temporal_actions_per_loop_hour",
    ):
        assert figures[key] is not None, key
    # Every loop checked at least once in the idle window: its history has actions in it.
    assert figures["temporal_actions_per_loop_hour"] > 0
