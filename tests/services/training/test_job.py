"""The train job contract: outputs, metrics, and one clear stderr line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.training.checkpoint import load_checkpoint, read_manifest
from services.training.job import train_job_main
from tests.services.training.conftest import read_metrics, write_spec, write_train_spec

REPO = Path(__file__).resolve().parents[3]


def run_job(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = train_job_main(argv)
    return code, capsys.readouterr().err


def assert_one_line(err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ratchet job: ")
    assert fragment in lines[0]


def test_sft_job_outputs(tiny_champion: Path) -> None:
    out = tiny_champion.parent
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "steps",
        "wall_s",
        "train_tokens",
        "rollout_tokens",
        "tokens_per_s",
        "filtered_zero_variance_groups",
        "final_reward",
        "device",
        "world_size",
    ):
        assert key in metrics
    assert metrics["steps"] == 40 and metrics["world_size"] == 1 and metrics["device"] == "cpu"
    assert metrics["checkpoint_id"] == load_checkpoint(tiny_champion).manifest.checkpoint_id
    # SFT spends its time in updates and in saving its checkpoint; it rolls nothing out
    assert set(metrics["phases"]) == {"update", "sync"}
    assert metrics["phases"]["update"]["seconds"] > 0


def test_grpo_job_outputs_and_idempotent_rerun(
    tmp_path: Path,
    tiny_champion: Path,
    task_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = write_train_spec(
        tmp_path,
        algorithm="grpo",
        environment="toolcalc",
        dataset=task_files["v2"],
        base_checkpoint=tiny_champion,
        hyperparameters={
            "steps": 2,
            "tasks_per_step": 2,
            "group_size": 4,
            "max_turns": 3,
            "max_new_tokens": 16,
            "log_every": 0,
        },
    )
    code, err = run_job(["--spec", str(spec)], capsys)
    assert code == 0, err
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 2 and metrics["groups"] == 4
    assert metrics["rollout_tokens"] > 0
    assert 0 <= metrics["filtered_zero_variance_groups"] <= 4
    # where the run's time went (an update only where a group had reward variance)
    phases = metrics["phases"]
    assert {"rollout", "scoring", "sync"} <= set(phases) <= {"rollout", "scoring", "update", "sync"}
    assert all(p["seconds"] > 0 and p["compute_s"] == p["seconds"] for p in phases.values())
    trained = sum(p["seconds"] for name, p in phases.items() if name != "sync")
    assert trained <= metrics["wall_s"]
    manifest = read_manifest(tmp_path / "out" / "checkpoint")
    assert manifest.parent == read_manifest(tiny_champion).checkpoint_id
    # a retried job with complete outputs does nothing and succeeds
    code, _ = run_job(["--spec", str(spec)], capsys)
    assert code == 0
    assert read_manifest(tmp_path / "out" / "checkpoint") == manifest


def test_env_vars_fill_paths(
    tmp_path: Path,
    tiny_champion: Path,
    task_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = write_spec(
        tmp_path / "spec.json",
        kind="train",
        algorithm="grpo",
        hyperparameters={
            "steps": 1,
            "tasks_per_step": 1,
            "group_size": 2,
            "max_turns": 2,
            "max_new_tokens": 8,
            "log_every": 0,
        },
    )
    monkeypatch.setenv("RATCHET_DATASET", str(task_files["v2"]))
    monkeypatch.setenv("RATCHET_BASE_CHECKPOINT", str(tiny_champion))
    monkeypatch.setenv("RATCHET_OUTPUT_DIR", str(tmp_path / "env-out"))
    code, err = run_job(["--spec", str(spec)], capsys)
    assert code == 0, err
    assert (tmp_path / "env-out" / "metrics.json").is_file()


@pytest.mark.parametrize(
    ("spec_text", "fragment"),
    [
        ("{not json", "is not valid JSON"),
        ('["list"]', "must hold a JSON object"),
        ('{"schema": "ratchet.job/v0", "kind": "train"}', "spec schema must be 'ratchet.job/v1'"),
        (
            '{"schema": "ratchet.job/v1", "kind": "deploy", "run_id": "r"}',
            "unknown job kind 'deploy'",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "/tmp/x",'
            ' "algorithm": "ppo"}',
            "unknown algorithm 'ppo'",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "algorithm": "sft"}',
            "no output dir",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "sft", "environment": "chess"}',
            "unknown environment 'chess'",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "sft"}',
            "no dataset",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "sft", "dataset": "/nonexistent/tasks.jsonl"}',
            "dataset /nonexistent/tasks.jsonl does not exist",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "grpo", "dataset": "DATA"}',
            "grpo needs a base checkpoint",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "grpo", "dataset": "DATA", "base_checkpoint": "/nonexistent"}',
            "base checkpoint /nonexistent does not exist",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "sft", "dataset": "DATA", "hyperparameters": {"stepz": 3}}',
            "unknown hyperparameter(s) for SFTConfig: stepz",
        ),
        (
            '{"schema": "ratchet.job/v1", "kind": "train", "run_id": "r", "output_dir": "OUT",'
            ' "algorithm": "sft", "dataset": "DATA", "device": "tpu"}',
            "spec 'device' must be auto, cpu or cuda",
        ),
    ],
)
def test_bad_specs_fail_with_one_line(
    tmp_path: Path,
    task_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    spec_text: str,
    fragment: str,
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(
        spec_text.replace("OUT", str(tmp_path / "out")).replace("DATA", str(task_files["v1"]))
    )
    code, err = run_job(["--spec", str(spec)], capsys)
    assert code != 0
    assert_one_line(err, fragment)


def test_missing_spec_and_bad_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_job(["--spec", str(tmp_path / "absent.json")], capsys)
    assert code != 0
    assert_one_line(err, "does not exist")
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"schema": "ratchet.task/v1"}\n')
    spec = write_train_spec(tmp_path, algorithm="sft", dataset=bad)
    code, err = run_job(["--spec", str(spec)], capsys)
    assert code != 0
    assert_one_line(err, "invalid dataset")
    assert "line 1" in err


def test_tampered_base_checkpoint(
    tmp_path: Path,
    tiny_champion: Path,
    task_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_champion, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    spec = write_train_spec(
        tmp_path, algorithm="grpo", dataset=task_files["v2"], base_checkpoint=copy
    )
    code, err = run_job(["--spec", str(spec)], capsys)
    assert code != 0
    assert_one_line(err, "base checkpoint rejected")
    assert "model.safetensors" in err and "tampered" in err
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_module_entry_point(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('{"schema": "ratchet.job/v1", "kind": "eval", "run_id": "r"}')
    proc = subprocess.run(
        [sys.executable, "-m", "services.training.job", "--spec", str(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "ratchet job: unknown job kind 'eval' for this job (expected 'train')"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("threads", "expected"), [(1, 1), (None, 2)])
def test_a_job_runs_torch_on_its_threads_setting(
    tmp_path: Path, threads: int | None, expected: int
) -> None:
    """``hyperparameters.threads`` sizes torch's intra-op and inter-op pools, over the
    OMP_NUM_THREADS it was started with; without it the job keeps what it was given."""
    from services.environments import write_task_file
    from services.environments.toolcalc import ToolcalcEnvironment

    dataset = tmp_path / "tasks.jsonl"
    write_task_file(dataset, ToolcalcEnvironment().generate_tasks(2, seed=0, api_version="v1"))
    hyper: dict[str, object] = {
        "steps": 1,
        "batch_size": 2,
        "model": {"n_layer": 1, "n_head": 1, "d_model": 8, "max_seq_len": 192},
    }
    if threads is not None:
        hyper["threads"] = threads
    spec = write_train_spec(
        tmp_path, algorithm="sft", environment="toolcalc", dataset=dataset, hyperparameters=hyper
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.training.job", "--spec", str(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    log = proc.stdout + proc.stderr
    assert f"torch threads: {expected} intra-op" in log
    if threads is not None:
        assert f"torch threads: {threads} intra-op, {threads} inter-op" in log
