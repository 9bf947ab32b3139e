"""benchmarks/gpu_round.py, the script a lent GPU runs, at tiny size on a CPU: every step runs
and the JSON line it ends with carries the figures the docs record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.training.hf_support import build_tiny_llama

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_round_runs_end_to_end_on_a_cpu_at_tiny_size(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path / "model")
    command = [
        sys.executable, "benchmarks/gpu_round.py", "--quick", "--device", "cpu",
        "--threads", "1", "--model-dir", str(tmp_path / "model"), "--workdir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "gpu_round" and figures["device"] == "cpu"
    assert figures["episodes"] == 4 and figures["round_s"] > 0
    assert figures["rollout_mfu"] > 0 and figures["peak_gflops"] > 0
    assert set(figures["time_split"]) == {
        "forward",
        "sampling",
        "scheduling",
        "tool_calls",
        "tokenizer",
    }
    assert figures["forward_calls"]["decode_calls"] > 0
    assert figures["train_mfu"] > 0 and figures["train_s"] > 0
    # fp32 on a CPU: the engine's greedy tokens are generate's, its log-probs a recompute's
    assert figures["greedy_identical_to_generate"] == "2/2"
    assert figures["logprob_max_abs_diff"] < 1e-4
