"""benchmarks/trace_scale.py: its arguments, how figures become ratios and the bar, and a
``--quick`` run (10k and 100k traces) on a real stack whose JSON line carries every figure.
The 1M/10M figures come from a quiet machine (docs/deploy.md, "Partitioned trace bodies")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trace_scale import FIGURES, Size, parse_args, summarize

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "10,five"], "--sizes must be two integers"),
        (["--sizes", "100,10"], "--sizes must be two increasing positive counts"),
        (["--sizes", "10"], "--sizes must be two increasing positive counts"),
        (["--days", "5", "--pairs", "3"], "--days must exceed --pairs by 4"),
        (["--single", "0"], "must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_with_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_means_10k_and_100k() -> None:
    assert parse_args(["--quick"]).counts == (10_000, 100_000)
    assert parse_args([]).counts == (1_000_000, 10_000_000)


def test_each_ratio_is_the_large_cost_over_the_small_and_the_bar_needs_all() -> None:
    sizes = [Size("small", 10, "", 1, b"", 0), Size("large", 100, "", 1, b"", 0)]
    small = {figure: 1.0 for figure in FIGURES} | {"retention_day_s": 0.1}
    large = {figure: 1.2 for figure in FIGURES} | {"retention_day_s": 0.12}
    runs = {"small": [small, small], "large": [large, {**large, "single_p99_ms": 9.0}]}
    result = summarize(runs, sizes, {})
    assert result["single_p50_ratio"] == 1.2
    assert result["batch_s_per_trace_ratio"] == 1.2  # a rate's inverse: seconds per trace
    assert result["single_p99_ratio"] == 5.1  # the median of 1.2 and 9.0
    assert result["retention_day_s"] == 0.12
    assert result["bar_met"] is False  # one figure over 1.3
    runs["large"] = [large, large]
    assert summarize(runs, sizes, {})["bar_met"] is True
    slow_retention = {**large, "retention_day_s": 1.2}
    runs = {"small": [{**small, "retention_day_s": 1.0}], "large": [slow_retention]}
    assert summarize(runs, sizes, {})["bar_met"] is False  # a day took over 1 s


@pytest.mark.slow
def test_a_quick_run_prints_every_figure_last() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/trace_scale.py", "--quick", "--pairs", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["sizes"] == [10_000, 100_000] and figures["pairs"] == 1
    for figure in FIGURES:
        ratio = f"{figure.removesuffix('_s').removesuffix('_ms')}_ratio"
        assert figures[ratio] > 0, ratio
        assert figures[f"{figure}_small"] > 0 and figures[f"{figure}_large"] > 0
    assert 0 < figures["retention_day_s"] < 5
    assert (
        figures["disk"]["large"]["bodies_table_bytes"]
        > figures["disk"]["small"]["bodies_table_bytes"]
    )
