"""The eval job's probe set: written beside the results, listed in metrics.json, read back
only through that listing, and refused with a clear error when malformed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.evaluation.probes import (
    PROBES_FILE,
    ProbeFileError,
    read_listed_probes,
)
from services.inference.tiny import TinyEngine
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig

# A context long enough for toolcalc's chat rendering (system text, request) and a few tokens.
TINY = GPTConfig(max_seq_len=256, n_layer=1, n_head=2, d_model=16)


def run_eval(root: Path, out: Path, **hyper: Any) -> dict[str, Any]:
    """Run the eval job on ``root``'s checkpoint and tasks; its metrics.json."""
    spec = root / f"spec-{out.name}.json"
    spec.write_text(
        json.dumps(
            {
                "schema": "ratchet.job/v1",
                "kind": "eval",
                "run_id": "e-probes",
                "environment": "toolcalc",
                "checkpoint": str(root / "ckpt"),
                "dataset": str(root / "tasks.jsonl"),
                "output_dir": str(out),
                "seed": 0,
                "device": "cpu",
                "hyperparameters": {"max_turns": 1, "max_new_tokens": 4, **hyper},
            }
        )
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("probes")
    torch.manual_seed(0)
    save_checkpoint(GPT(TINY), TINY, root / "ckpt")
    tasks = ToolcalcEnvironment().generate_tasks(6, seed=2, api_version="v1")
    write_task_file(root / "tasks.jsonl", tasks)
    out = root / "out"
    return root, out, run_eval(root, out)


def test_the_eval_job_lists_its_probe_set_and_it_is_what_the_engine_answers(
    evaluated: tuple[Path, Path, dict[str, Any]],
) -> None:
    root, out, metrics = evaluated
    listing = metrics["probes"]
    data = (out / PROBES_FILE).read_bytes()
    assert listing == {
        "file": PROBES_FILE,
        "sha256": hashlib.sha256(data).hexdigest(),
        "count": 4,
    }
    probe_set = read_listed_probes(out, metrics)
    assert probe_set is not None and probe_set.checkpoint_id == metrics["checkpoint_id"]
    assert len(probe_set.probes) == 4
    engine = TinyEngine.load(root / "ckpt", device="cpu")
    for probe in probe_set.probes:
        # The request is the task's first chat turn; its prompt ids are the server's render.
        assert [m["role"] for m in probe.messages] == ["system", "user"]
        assert probe.tools and probe.prompt_token_ids
        assert 1 <= len(probe.token_ids) <= probe.max_tokens
        assert len(probe.logprobs) == len(probe.token_ids) + (probe.stop_id is not None)
        assert all(lp <= 0 for lp in probe.logprobs)
        assert probe.text == engine.decode_text(probe.token_ids)


def test_no_probes_when_asked_for_none(evaluated: tuple[Path, Path, dict[str, Any]]) -> None:
    root, _, _ = evaluated
    metrics = run_eval(root, root / "none", probes=0)
    assert "probes" not in metrics
    assert not (root / "none" / PROBES_FILE).exists()
    assert read_listed_probes(root / "none", metrics) is None


def test_a_probe_file_not_in_the_listing_is_ignored(
    evaluated: tuple[Path, Path, dict[str, Any]],
) -> None:
    _, out, metrics = evaluated
    unlisted = {k: v for k, v in metrics.items() if k != "probes"}
    assert (out / PROBES_FILE).is_file()  # there, but its run does not list it
    assert read_listed_probes(out, unlisted) is None


def tampered(tmp_path: Path, body: Any) -> tuple[Path, dict[str, Any]]:
    """A run dir holding ``body`` as its probe file, listed with its true hash."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    (tmp_path / PROBES_FILE).write_bytes(data)
    listing = {"file": PROBES_FILE, "sha256": hashlib.sha256(data).hexdigest(), "count": 1}
    return tmp_path, {"probes": listing}


def good_document(out: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((out / PROBES_FILE).read_text())
    return document


def test_a_probe_file_of_another_hash_is_refused(
    evaluated: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, out, metrics = evaluated
    (tmp_path / PROBES_FILE).write_text((out / PROBES_FILE).read_text() + " ")
    with pytest.raises(ProbeFileError, match="does not match the sha256"):
        read_listed_probes(tmp_path, metrics)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "{not json", "is not JSON"),
        (lambda d: [], "must be a JSON object"),
        (lambda d: {**d, "schema": "ratchet.probes/v0"}, "probes.schema must be"),
        (lambda d: {**d, "probes": []}, r"probes.probes must be a list of 1 to"),
        (
            lambda d: {**d, "probes": [{**d["probes"][0], "token_ids": ["a"]}]},
            r"probes.probes\[0\].token_ids must be a list of non-negative integers",
        ),
        (
            lambda d: {**d, "probes": [{**d["probes"][0], "logprobs": [0.5]}]},
            r"probes.probes\[0\].logprobs must hold \d+ finite numbers",
        ),
        (
            lambda d: {**d, "probes": [{**d["probes"][0], "messages": [{"role": "robot"}]}]},
            r"probes.probes\[0\].messages\[0\].role must be one of",
        ),
        (
            lambda d: {**d, "probes": [{**d["probes"][0], "max_tokens": True}]},
            r"probes.probes\[0\].max_tokens must be an integer",
        ),
    ],
)
def test_a_malformed_probe_file_is_a_clear_error(
    evaluated: tuple[Path, Path, dict[str, Any]],
    tmp_path: Path,
    edit: Any,
    message: str,
) -> None:
    _, out, _ = evaluated
    run_dir, metrics = tampered(tmp_path, edit(good_document(out)))
    with pytest.raises(ProbeFileError, match=message):
        read_listed_probes(run_dir, metrics)


def test_a_bad_listing_or_a_planted_link_is_refused(
    evaluated: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, out, metrics = evaluated
    with pytest.raises(ProbeFileError, match=r"metrics\.probes must be an object"):
        read_listed_probes(out, {"probes": "probes.json"})
    with pytest.raises(ProbeFileError, match=r"metrics\.probes\.file must be 'probes\.json'"):
        read_listed_probes(out, {"probes": {**metrics["probes"], "file": "../secrets"}})
    (tmp_path / PROBES_FILE).symlink_to(out / PROBES_FILE)
    with pytest.raises(ProbeFileError, match="symlinks are refused"):
        read_listed_probes(tmp_path, metrics)
    with pytest.raises(ProbeFileError, match="cannot read the probe set"):
        read_listed_probes(tmp_path / "absent", metrics)
