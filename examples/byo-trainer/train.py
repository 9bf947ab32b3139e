#!/usr/bin/env python3
"""A trainer that is a plain script: the job contract with nothing but the standard library.

Run by an executor as ``<command...> train --spec <path>`` (the loop's
``training_profile.train_job.command`` is ``["python3", "/path/to/train.py"]``). What it
reads and writes is the whole contract (docs/deploy.md, "Plug in your own trainer"):

- reads  ``RATCHET_JOB_SPEC`` (the ``ratchet.job/v1`` spec), ``RATCHET_DATASET`` (the task
  file, JSONL), ``RATCHET_BASE_CHECKPOINT`` (the champion's checkpoint directory);
- writes ``$RATCHET_OUTPUT_DIR/checkpoint/`` (``model.safetensors``, ``config.json``,
  ``tokenizer.json`` and ``manifest.json`` with the sha256 of each and the parent's id) and
  ``$RATCHET_OUTPUT_DIR/metrics.json``, then exits 0;
- on a bad spec, exits 64 with one line on stderr (the run fails at once, no retry).

Where your optimiser would update the weights, this example stamps the champion's weights
with the run id in the safetensors header (the tensors are untouched), so the candidate is
a checkpoint of its own. Replace ``train`` with your training loop; keep the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

CONTENT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
EX_CONFIG = 64  # sysexits.h EX_USAGE: the spec is wrong, retrying cannot help


def fail(message: str, code: int = 1) -> None:
    print(f"plain-trainer: {message}", file=sys.stderr)
    sys.exit(code)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(checkpoint: Path, parent: str | None, metadata: dict[str, object]) -> str:
    """The manifest Ratchet verifies: each file's sha256 and size, and the content id."""
    files = {
        name: {"sha256": sha256(checkpoint / name), "size": (checkpoint / name).stat().st_size}
        for name in CONTENT_FILES
    }
    lines = "".join(f"{files[name]['sha256']}  {name}\n" for name in sorted(files))
    checkpoint_id = hashlib.sha256(lines.encode()).hexdigest()
    manifest = {
        "schema": "ratchet.checkpoint/v1",
        "checkpoint_id": checkpoint_id,
        "format": "safetensors",
        "parent": parent,
        "files": files,
        "metadata": metadata,
    }
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return checkpoint_id


def stamp_safetensors(source: Path, target: Path, stamp: dict[str, str]) -> None:
    """Copy a safetensors file with ``stamp`` added to its header's ``__metadata__``."""
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"] = {**header.get("__metadata__", {}), **stamp}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the tensor data 8-byte aligned
    target.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def train(tasks: list[dict[str, object]], base: Path, out: Path, run_id: str) -> dict[str, object]:
    """Your training loop goes here. This one only stamps the base weights."""
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(base / name, out / name)
    stamp_safetensors(base / "model.safetensors", out / "model.safetensors", {"run": run_id})
    return {"tasks_seen": len(tasks), "steps": 0, "trainer": "plain-script"}


def main() -> None:
    if sys.argv[1:2] != ["train"]:
        fail(f"expected `train --spec PATH`, got {sys.argv[1:]}", EX_CONFIG)
    try:
        spec = json.loads(Path(os.environ["RATCHET_JOB_SPEC"]).read_text())
        dataset = Path(os.environ["RATCHET_DATASET"])
        base = Path(os.environ["RATCHET_BASE_CHECKPOINT"])
        output = Path(os.environ["RATCHET_OUTPUT_DIR"])
    except (KeyError, OSError, json.JSONDecodeError) as exc:
        fail(f"the job contract's inputs are missing or unreadable: {exc}", EX_CONFIG)
    if spec.get("schema") != "ratchet.job/v1" or spec.get("kind") != "train":
        fail("the spec is not a ratchet.job/v1 train spec", EX_CONFIG)
    tasks = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    parent = json.loads((base / "manifest.json").read_text())["checkpoint_id"]

    checkpoint = output / "checkpoint"
    if checkpoint.exists():  # a restarted job starts its output over
        shutil.rmtree(checkpoint)
    checkpoint.mkdir(parents=True)
    metrics = train(tasks, base, checkpoint, spec["run_id"])
    checkpoint_id = write_manifest(checkpoint, parent, {"run_id": spec["run_id"]})
    metrics["checkpoint_id"] = checkpoint_id
    (output / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))


if __name__ == "__main__":
    main()
