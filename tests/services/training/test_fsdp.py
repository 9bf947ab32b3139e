"""FSDP2 sharding (``sharding: fsdp``) on a real process group: two ranks with gloo on the
CPU compute the loss and gradients one process computes, within 1e-5, for a LoRA adapter
and for every weight; a save of the sharded weights is the unsharded save, byte for byte;
a resume point of shards restores every rank's weights and optimizer state; a sharded GRPO
job run with torchrun trains the adapter the one-process job trains; and benchmarks/fsdp.py
runs (a smoke run of its full fine-tuning on two ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from tests.services.training.conftest import (
    job_command,
    read_metrics,
    run_job_process,
    torchrun_job_command,
    write_train_spec,
)
from tests.services.training.fsdp_support import Case, sharded_rank, single_process
from tests.services.training.hf_support import build_tiny_llama
from tests.support import free_port


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    build_tiny_llama(root / "llama")
    return install_checkpoint(root / "llama", ArtifactStore(root / "store")).target


def read(out: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    result = json.loads((out / "result.json").read_text())
    return result, load_file(str(out / "grads.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_sharded_ranks_compute_the_one_process_loss_and_gradients(
    llama: Path, tmp_path: Path, lora: bool
) -> None:
    single = Case(llama, lora, tmp_path / "single")
    sharded = Case(llama, lora, tmp_path / "sharded", port=free_port())
    single_process(single)
    mp.start_processes(sharded_rank, args=(2, sharded), nprocs=2, start_method="spawn")

    one, one_grads = read(single.out)
    two, two_grads = read(sharded.out)
    assert two["sharded"] is True
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert set(two_grads) == set(one_grads)
    assert any(float(g.abs().max()) > 0 for g in one_grads.values())  # something to compare
    for name, grad in one_grads.items():
        torch.testing.assert_close(two_grads[name], grad, rtol=0, atol=1e-5, msg=name)
    # gathered to rank 0 and written as the unsharded model writes: the same bytes
    assert two["checkpoint_id"] == one["checkpoint_id"]
    assert two["resumed"] is True


@pytest.mark.slow
def test_a_sharded_grpo_job_trains_the_adapter_one_process_trains(
    llama: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(4, seed=4, api_version="v2"))
    hyper = {
        "steps": 2,
        "tasks_per_step": 2,
        "group_size": 2,
        "max_turns": 2,
        "max_new_tokens": 8,
        "temperature": 1.5,
        "lr": 1e-2,
        "sft_coef": 0.5,  # the adapter moves even when every group is filtered
        "log_every": 0,
        "threads": 1,
    }
    runs = {"single": (job_command, "none"), "sharded": (torchrun_job_command, "fsdp")}
    for name, (command, sharding) in runs.items():
        spec = write_train_spec(
            tmp_path / name,
            algorithm="grpo",
            environment="toolcalc",
            dataset=tasks,
            base_checkpoint=llama,
            hyperparameters={**hyper, "sharding": sharding},
        )
        run_job_process(command(spec), timeout=600)

    one, two = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "sharded")
    assert (one["sharding"], two["sharding"]) == ("none", "fsdp")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for key in ("rollout_tokens", "train_tokens", "episodes", "groups"):
        assert one[key] == two[key], key
    # each rank's peak memory, in rank order
    assert one["peak_memory"]["kind"] == two["peak_memory"]["kind"] == "max_rss"
    assert len(two["peak_memory"]["bytes"]) == 2 and min(two["peak_memory"]["bytes"]) > 0
    a = load_file(str(tmp_path / "single" / "out" / "checkpoint" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "sharded" / "out" / "checkpoint" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    moved = False
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
        moved = moved or bool(a[key].abs().max() > 0)
    assert moved
    # the resume points of the sharded run are shards, one per rank
    point = sorted((tmp_path / "sharded" / "out" / "state").glob("step-*"))[-1]
    assert {f.name for f in point.glob("*rank*")} == {
        "weights-rank-00000.safetensors",
        "weights-rank-00001.safetensors",
        "optimizer-rank-00000.safetensors",
        "optimizer-rank-00001.safetensors",
    }


@pytest.mark.slow
def test_the_fsdp_benchmark_runs_both_arms_and_prints_its_figures(tmp_path: Path) -> None:
    """benchmarks/fsdp.py --quick: the same full fine-tuning as one process and as two
    sharded gloo ranks through the real job; the figures, not their values, are checked
    (times on a shared machine are not figures), and the weights agree."""
    import subprocess
    import sys

    from tests.services.training.conftest import REPO

    done = subprocess.run(
        [sys.executable, "benchmarks/fsdp.py", "--quick", "--workdir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert (figures["benchmark"], figures["training"], figures["ranks"]) == ("fsdp", "full", 2)
    single, sharded = figures["arms"]["single"], figures["arms"]["sharded"]
    assert (single["world_size"], single["sharding"]) == (1, "none")
    assert (sharded["world_size"], sharded["sharding"]) == (2, "fsdp")
    assert len(sharded["peak_memory"]["bytes"]) == 2 and figures["peak_memory_ratio"] > 0
    assert sharded["final_loss"] == pytest.approx(single["final_loss"], abs=1e-5)
    assert figures["max_weight_difference"] < 1e-5
    assert {"threads", "loadavg_start", "loadavg_end"} <= set(figures)
