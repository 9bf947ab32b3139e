"""The eval job contract and the evaluator's per-task results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import evaluate
from services.evaluation.job import eval_job_main
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig, TinyModel

REPO = Path(__file__).resolve().parents[3]
TINY = GPTConfig(max_seq_len=128, n_layer=1, n_head=2, d_model=16)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    save_checkpoint(GPT(TINY), TINY, root / "ckpt")
    write_task_file(
        root / "tasks.jsonl", ToolcalcEnvironment().generate_tasks(6, seed=2, api_version="v1")
    )
    return root / "ckpt", root / "tasks.jsonl"


def write_spec(path: Path, **fields: object) -> Path:
    path.write_text(
        json.dumps(
            {
                "schema": "ratchet.job/v1",
                "kind": "eval",
                "run_id": "e-1",
                "seed": 0,
                "device": "cpu",
                **fields,
            }
        )
    )
    return path


def test_eval_job_writes_results_and_metrics(
    tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, tasks = inputs
    spec = write_spec(
        tmp_path / "spec.json",
        checkpoint=str(checkpoint),
        dataset=str(tasks),
        output_dir=str(tmp_path / "out"),
        samples=2,
        hyperparameters={"temperature": 1.0, "max_turns": 2, "max_new_tokens": 8},
    )
    assert eval_job_main(["--spec", str(spec)]) == 0, capsys.readouterr().err
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 6
    for row in rows:
        assert {"task_id", "passed", "reward", "components", "turns"} <= set(row)
        assert row["samples"] == 2 and 1 <= row["turns"] <= 2
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["n"] == 6 and metrics["passed"] == sum(r["passed"] for r in rows)
    assert 0.0 <= metrics["ci_low"] <= metrics["pass_rate"] <= metrics["ci_high"] <= 1.0
    assert metrics["tokens_per_s"] > 0 and metrics["checkpoint_id"]


def test_evaluator_passes_a_solving_policy(inputs: tuple[Path, Path]) -> None:
    """A policy replaying demonstrations passes every task: rollout and verifier agree."""
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(5, seed=4, api_version="v2")
    demos = {t.prompt: env.demonstration(t) for t in tasks}

    class Replay(TinyModel):
        def generate(self, prompts, *, max_new_tokens=32, temperature=0.0, seed=0):  # type: ignore[no-untyped-def]
            out = []
            for prompt in prompts:
                demo = next(d for p, d in demos.items() if prompt.startswith(p))
                done = prompt.count("\n> ") - 1  # the transcript ends with the open turn
                out.append(demo.agent_turns[done].text)
            return out

    torch.manual_seed(0)
    result = evaluate(Replay(GPT(TINY)), env, tasks)
    assert result.passed == 5 and result.pass_rate == 1.0
    assert all(
        r.turns == len(demos[t.prompt].agent_turns)
        for r, t in zip(result.results, tasks, strict=True)
    )


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"checkpoint": "/nonexistent"}, "checkpoint /nonexistent does not exist"),
        ({"dataset": "/nonexistent.jsonl"}, "dataset /nonexistent.jsonl does not exist"),
        ({"samples": 0}, "'samples' must be a positive integer"),
        ({"hyperparameters": {"temprature": 1}}, "unknown eval hyperparameter(s): temprature"),
        ({"kind": "train"}, "unknown job kind 'train'"),
        ({"rollout_backend": {"url": "vllm:8000", "model": "m"}}, "rollout_backend.url must be"),
        ({"rollout_backend": {"url": "http://v:8000", "model": "m"}}, "tiny family rolls out"),
    ],
)
def test_eval_bad_specs(
    tmp_path: Path,
    inputs: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    fields: dict[str, object],
    fragment: str,
) -> None:
    checkpoint, tasks = inputs
    base: dict[str, object] = {
        "checkpoint": str(checkpoint),
        "dataset": str(tasks),
        "output_dir": str(tmp_path / "out"),
    }
    spec = write_spec(tmp_path / "spec.json", **{**base, **fields})
    assert eval_job_main(["--spec", str(spec)]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet job: ") and fragment in lines[0]


def test_eval_tampered_checkpoint(
    tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    checkpoint, tasks = inputs
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("16", "17", 1))
    spec = write_spec(
        tmp_path / "spec.json",
        checkpoint=str(copy),
        dataset=str(tasks),
        output_dir=str(tmp_path / "out"),
    )
    assert eval_job_main(["--spec", str(spec)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint rejected" in err[0] and "config.json" in err[0]


def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.evaluation.job", "--spec", str(tmp_path / "nope.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"ratchet job: spec file {tmp_path / 'nope.json'} does not exist"
    ]


def test_job_output_is_read_without_following_symlinks(tmp_path: Path) -> None:
    from services.evaluation.results import (
        RESULTS_FILE,
        ResultsFileError,
        read_job_output,
        read_results,
    )

    secret = tmp_path / "environ"
    secret.write_text('{"task_id": "RATCHET_DATABASE_URL=postgresql://u:pw@db/x"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / RESULTS_FILE).symlink_to(secret)
    with pytest.raises(ResultsFileError, match="not a regular file"):
        read_results(out)
    (out / "metrics.json").symlink_to(secret)
    with pytest.raises(OSError, match="symlinks are refused"):
        read_job_output(out / "metrics.json")
    (out / "big.json").write_text("x" * 100)
    with pytest.raises(OSError, match="larger than"):
        read_job_output(out / "big.json", limit=10)
