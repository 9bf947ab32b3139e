"""benchmarks/gateway.py: its pure parts (per-pair differences, the inside quantiles between
two readings, the profile's summary, the refusals of bad arguments) and a smoke run at tiny
sizes whose JSON line, printed last, carries every figure. The figures themselves, and the
machine they were taken on, are in docs/gateway.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gateway import (
    Timing,
    has_text,
    inside_quantiles,
    pair_differences,
    parse,
    profile_summary,
    quantile,
)

REPO = Path(__file__).resolve().parents[2]


def test_differences_are_taken_within_each_pair_whichever_target_went_first() -> None:
    timings = [
        # client 0 starts direct: pairs (turns 0, 1) and (2, 3)
        Timing(0, 0, 0, 0.100, 0.050),
        Timing(0, 1, 1, 0.103, 0.052),
        Timing(0, 2, 0, 0.500, 0.300),
        Timing(0, 3, 1, 0.501, 0.304),
        # client 1 starts through the gateway
        Timing(1, 0, 1, 0.020, 0.010),
        Timing(1, 1, 0, 0.018, 0.009),
        # an unfinished pair is left out
        Timing(1, 2, 1, 9.0, 9.0),
    ]
    assert sorted(round(d, 6) for d in pair_differences(timings)) == [0.001, 0.002, 0.003]
    firsts = pair_differences(timings, first=True)
    assert sorted(round(d, 6) for d in firsts) == [0.001, 0.002, 0.004]


def test_a_slow_moment_shared_by_a_pair_does_not_become_added_latency() -> None:
    # Each pair ran under its own load; the gateway adds 1 ms to every one of them. The
    # quantiles' difference misreads the tail; the per-pair differences do not.
    timings = []
    for client in range(100):
        base = 0.010 if client < 98 else 1.0 - 0.4 * (client == 99)
        timings += [Timing(client, 0, 0, base, base), Timing(client, 1, 1, base + 0.001, base)]
    added = pair_differences(timings)
    assert round(quantile(added, 0.5), 6) == round(quantile(added, 0.99), 6) == 0.001


def test_inside_quantiles_count_only_what_came_between_the_two_readings() -> None:
    before = [(0.001, 100.0), (0.002, 100.0), (0.005, 100.0), (float("inf"), 100.0)]
    after = [(0.001, 100.0), (0.002, 150.0), (0.005, 200.0), (float("inf"), 200.0)]
    p50, p99 = inside_quantiles(before, after)
    assert p50 == 2.0  # half of the 100 new requests took up to 2 ms
    assert p99 is not None and 4.9 < p99 <= 5.0
    assert inside_quantiles(after, after) == (None, None)


def test_the_profile_summary_ranks_functions_with_and_without_callees() -> None:
    collapsed = "\n".join(
        [
            "thread (0x1);main (app.py);send (forward.py) 6",
            "thread (0x1);main (app.py);dumps (json.py) 3",
            "thread (0x2);drain (writer.py) 1",
        ]
    )
    lines = profile_summary(collapsed, top=2)
    assert lines[0] == "10 samples"
    assert lines[1:4] == ["threads:", "   90.0%  thread (0x1)", "   10.0%  thread (0x2)"]
    assert lines[4:7] == ["with callees:", "   90.0%  main (app.py)", "   60.0%  send (forward.py)"]
    assert lines[7:] == ["self:", "   60.0%  send (forward.py)", "   30.0%  dumps (json.py)"]
    assert profile_summary("") == ["(no samples)"]


@pytest.mark.parametrize("flag", ["--clients", "--low-clients", "--requests", "--ttft-pairs"])
def test_counts_below_one_are_refused_with_the_flag(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse([flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_prints_every_figure_last() -> None:
    command = [
        sys.executable, "benchmarks/gateway.py", "--clients", "4", "--requests", "40",
        "--low-requests", "10", "--rps-seconds", "1", "--model", "tiny", "--ttft-pairs", "2",
        "--think-ms", "5",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["captured_lost"] == 0
    assert figures["clients"] == 4 and figures["low_clients"] == 1 and figures["think_ms"] == 5
    for key in (
        "added_p50_ms",
        "added_p99_ms",
        "quantile_added_p50_ms",
        "inside_p50_ms",
        "added_p50_ms_low",
        "inside_p50_ms_low",
        "gateway_rps_one_core",
        "ttft_ratio",
        "ttft_ratio_low",
        "ttft_added_p50_ms_low",
    ):
        assert figures[key] is not None, key


def test_the_first_token_is_the_first_chunk_with_text_not_the_opening_one() -> None:
    opening = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    assert not has_text(opening)
    assert has_text(b'{"choices":[{"index":0,"delta":{"content":"Hi"}}]}')
    assert has_text(b'{"choices":[{"index":0,"text":"Hi"}]}')
    assert not has_text(b"[DONE]") and not has_text(b'{"choices":[]}')
