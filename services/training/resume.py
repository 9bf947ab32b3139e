"""Periodic training state and resume-from-last, so a killed job continues where it stopped.

A resume point is ``<state_dir>/step-<NNNNNN>/`` holding the trainable weights by name
(``weights.safetensors``: every weight of a tiny model, the adapter of an hf LoRA run), the
optimizer state (``optimizer.safetensors``) and ``state.json`` (the step, the trainer's
counters and both files' sha256). The frozen weights are the job's base checkpoint, loaded
and verified again on resume, so a point of any family is as small as what it trains. A
point written before this layout (a tiny ``checkpoint/``) still loads. It is assembled in a temp
directory and renamed into place, so a kill during the write leaves the previous point
intact. Together with counter-based sampling (:mod:`services.training.rng`) and a data
order that is a pure function of (seed, step), resuming reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    read_safetensors,
    safetensors_bytes,
    save_optimizer_state,
    sha256_file,
)

NamedParameters = list[tuple[str, torch.nn.Parameter]]

_PREFIX = "step-"
KEEP_POINTS = 2


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int
    counters: dict[str, Any]


def save_resume_point(
    state_dir: Path,
    *,
    step: int,
    params: NamedParameters,
    optimizer: torch.optim.Optimizer,
    counters: dict[str, Any],
) -> ResumePoint:
    """Write the resume point for ``step`` (steps done so far) and prune older ones."""
    state_dir.mkdir(parents=True, exist_ok=True)
    final = state_dir / f"{_PREFIX}{step:06d}"
    tmp = state_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {name: param.detach() for name, param in params}
    (tmp / "weights.safetensors").write_bytes(safetensors_bytes(weights, {"format": "pt"}))
    save_optimizer_state(optimizer, tmp / "optimizer.safetensors")
    state = {
        "step": step,
        "counters": counters,
        "optimizer_sha256": sha256_file(tmp / "optimizer.safetensors"),
        "weights_sha256": sha256_file(tmp / "weights.safetensors"),
    }
    (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(state_dir.glob(f"{_PREFIX}*"))[:-KEEP_POINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return ResumePoint(final, step, counters)


def latest_resume_point(state_dir: Path) -> ResumePoint | None:
    """The newest complete resume point under ``state_dir``, if any."""
    if not state_dir.is_dir():
        return None
    for path in sorted(state_dir.glob(f"{_PREFIX}*"), reverse=True):
        state_file = path / "state.json"
        if not state_file.is_file():
            continue
        state = json.loads(state_file.read_text())
        return ResumePoint(path, int(state["step"]), dict(state.get("counters", {})))
    return None


def load_resume_point(
    point: ResumePoint, *, params: NamedParameters, optimizer: torch.optim.Optimizer
) -> None:
    """Restore the trainable weights and optimizer state (both verified) from ``point``."""
    state = json.loads((point.path / "state.json").read_text())
    weights_file = point.path / "weights.safetensors"
    if weights_file.is_file():
        if sha256_file(weights_file) != state.get("weights_sha256"):
            raise CheckpointError(f"weights in {point.path} do not match their sha256")
        weights = read_safetensors(weights_file)
    else:  # a tiny point of the earlier layout: a whole checkpoint
        weights = load_checkpoint(point.path / "checkpoint").state_dict
    names = [name for name, _ in params]
    missing = sorted(set(names) - set(weights))
    if missing:
        raise CheckpointError(f"resume point {point.path} lacks weights {missing[:3]}")
    with torch.no_grad():
        for name, param in params:
            param.copy_(weights[name].to(device=param.device, dtype=param.dtype))
    optimizer_file = point.path / "optimizer.safetensors"
    if sha256_file(optimizer_file) != state.get("optimizer_sha256"):
        raise CheckpointError(f"optimizer state in {point.path} does not match its sha256")
    load_optimizer_state(optimizer, optimizer_file)
