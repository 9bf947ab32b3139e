"""benchmarks/rft_round.py: an rft round sampled again from a run's spec, the adapter folded
against peft's path, at tiny size; and the run directories it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.foreign_loop import HarnessError
from benchmarks.rft_round import read_run
from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from tests.services.training.conftest import run_train_job
from tests.services.training.hf_support import build_tiny_llama

REPO = Path(__file__).resolve().parents[2]


def rft_run(root: Path, dataset: Path, base: Path) -> Path:
    """A run directory as a stack leaves it: the rft job's spec beside its outputs."""
    run = root / "run"
    run.mkdir()
    spec = {
        "schema": "ratchet.job/v1",
        "kind": "train",
        "algorithm": "rft",
        "run_id": "round",
        "environment": "toolcalc",
        "dataset": str(dataset),
        "base_checkpoint": str(base),
    }
    (run / "spec.json").write_text(json.dumps(spec))
    return run


@pytest.mark.slow
def test_the_round_samples_the_same_tokens_folded_and_through_peft(tmp_path: Path) -> None:
    dataset = tmp_path / "tasks.jsonl"
    write_task_file(dataset, ToolcalcEnvironment().generate_tasks(4, seed=3, api_version="v1"))
    build_tiny_llama(tmp_path / "llama")
    store = ArtifactStore(tmp_path / "store")
    base = install_checkpoint(tmp_path / "llama", store).target
    code = run_train_job(
        tmp_path / "sft",
        algorithm="sft",
        dataset=dataset,
        base_checkpoint=base,
        hyperparameters={"steps": 2, "batch_size": 4, "lr": 5e-3, "log_every": 0},
    )
    assert code == 0
    adapter = install_checkpoint(tmp_path / "sft" / "out" / "checkpoint", store).target
    run = rft_run(tmp_path, dataset, adapter)
    command = [
        sys.executable, "benchmarks/rft_round.py", "--run-dir", str(run), "--tasks", "3",
        "--samples", "2", "--pairs", "1", "--threads", "1", "--max-turns", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "rft_round" and figures["same_tokens"] is True
    assert figures["tasks"] == 3 and figures["folded_wall_s"] > 0
    assert set(figures["runs"]) == {"peft", "folded"}
    assert figures["runs"]["folded"][0]["forward_calls"]["decode_calls"] > 0


def test_a_directory_without_an_rft_spec_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match=r"no spec\.json"):
        read_run(tmp_path)
    (tmp_path / "spec.json").write_text("{not json")
    with pytest.raises(HarnessError, match="is not JSON"):
        read_run(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps(["train"]))
    with pytest.raises(HarnessError, match="not an rft train job"):
        read_run(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps({"kind": "eval"}))
    with pytest.raises(HarnessError, match="not an rft train job"):
        read_run(tmp_path)
    spec = {"kind": "train", "algorithm": "rft", "dataset": str(tmp_path / "gone.jsonl")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(HarnessError, match=r"dataset .* is not on this machine"):
        read_run(tmp_path)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_a_count_below_one_or_not_a_number_is_refused_by_the_parser(value: str) -> None:
    command = [sys.executable, "benchmarks/rft_round.py", "--run-dir", ".", "--tasks", value]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--tasks" in done.stderr and "Traceback" not in done.stderr
