"""Real processes: a GRPO job killed with SIGKILL resumes to the same end state, and two
data-parallel ranks (torchrun, gloo) reproduce the single-process run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from services.training.checkpoint import load_checkpoint
from tests.services.training.conftest import (
    REPO,
    job_command,
    read_metrics,
    run_job_process,
    torchrun_job_command,
    write_train_spec,
)

GRPO_HYPER = {
    "tasks_per_step": 4,
    "group_size": 4,
    "max_turns": 3,
    "max_new_tokens": 12,
    "lr": 3e-3,
    "sft_coef": 0.2,  # weights move every step even when every group is filtered
    "threads": 1,
    "log_every": 0,
}


def grpo_spec(root: Path, champion: Path, dataset: Path, **hyper: object) -> Path:
    return write_train_spec(
        root,
        algorithm="grpo",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=champion,
        hyperparameters={**GRPO_HYPER, **hyper},
    )


def test_kill_mid_run_then_resume_reaches_the_same_state(
    tmp_path: Path, tiny_champion: Path, task_files: dict[str, Path]
) -> None:
    steps = 10
    reference = grpo_spec(tmp_path / "reference", tiny_champion, task_files["v2"], steps=steps)
    run_job_process(job_command(reference))

    spec = grpo_spec(
        tmp_path / "killed", tiny_champion, task_files["v2"], steps=steps, checkpoint_every=2
    )
    state = tmp_path / "killed" / "out" / "state"
    proc = subprocess.Popen(
        job_command(spec), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not any(state.glob("step-*/state.json")):
            assert proc.poll() is None, "job ended before its first periodic checkpoint"
            assert time.monotonic() < deadline, "no periodic checkpoint appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "out" / "metrics.json").exists(), (
        "killed too late to test resume"
    )

    run_job_process(job_command(spec))
    resumed = read_metrics(tmp_path / "killed")
    expected = read_metrics(tmp_path / "reference")
    assert 2 <= resumed["resumed_from_step"] < steps
    assert resumed["steps"] == expected["steps"] == steps
    for key in ("rollout_tokens", "train_tokens", "filtered_zero_variance_groups", "final_reward"):
        assert resumed[key] == expected[key], key
    # content-addressed ids: bit-identical weights, config and tokenizer
    assert resumed["checkpoint_id"] == expected["checkpoint_id"]


def test_two_ranks_match_one_process(
    tmp_path: Path, tiny_champion: Path, task_files: dict[str, Path]
) -> None:
    single = grpo_spec(tmp_path / "single", tiny_champion, task_files["v2"], steps=2)
    run_job_process(job_command(single))
    ddp = grpo_spec(tmp_path / "ddp", tiny_champion, task_files["v2"], steps=2)
    run_job_process(torchrun_job_command(ddp))

    one = read_metrics(tmp_path / "single")
    two = read_metrics(tmp_path / "ddp")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for key in ("rollout_tokens", "train_tokens", "groups", "filtered_zero_variance_groups"):
        assert one[key] == two[key], key
    a = load_checkpoint(tmp_path / "single" / "out" / "checkpoint").state_dict
    b = load_checkpoint(tmp_path / "ddp" / "out" / "checkpoint").state_dict
    moved = load_checkpoint(tiny_champion).state_dict
    assert any(not torch.equal(a[name], moved[name]) for name in a)  # training happened
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
