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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from services.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_optimizer_state,
    read_safetensors,
    safetensors_bytes,
    save_optimizer_state,
    sha256_file,
)
from services.training.distributed import DistContext

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
    ctx: DistContext,
) -> ResumePoint | None:
    """Write the resume point for ``step`` (steps done so far) and prune older ones. Every
    rank calls it; rank 0 writes (every rank its own shards, for a sharded model) and gets
    the point, the others None."""
    sharded = any(isinstance(param, DTensor) for _, param in params)
    if not sharded and not ctx.is_main:
        return None
    final = state_dir / f"{_PREFIX}{step:06d}"
    tmp = state_dir / f".{final.name}.writing"
    if ctx.is_main:
        state_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if sharded:
        ctx.barrier()  # the directory exists before any rank writes into it
    suffix = f"-rank-{ctx.rank:05d}" if sharded else ""
    weights = {name: _local(param.detach()) for name, param in params}
    (tmp / f"weights{suffix}.safetensors").write_bytes(safetensors_bytes(weights, {"format": "pt"}))
    save_optimizer_state(optimizer, tmp / f"optimizer{suffix}.safetensors")
    if sharded:
        ctx.barrier()  # every shard is written before rank 0 seals the point
    if not ctx.is_main:
        return None
    state: dict[str, Any] = {"step": step, "counters": counters}
    if sharded:
        state["ranks"] = ctx.world_size
        state["files"] = {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}
    else:
        state["optimizer_sha256"] = sha256_file(tmp / "optimizer.safetensors")
        state["weights_sha256"] = sha256_file(tmp / "weights.safetensors")
    (tmp / "state.json").write_text(json.dumps(state, sort_keys=True, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(state_dir.glob(f"{_PREFIX}*"))[:-KEEP_POINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return ResumePoint(final, step, counters)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
    point: ResumePoint,
    *,
    params: NamedParameters,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext | None = None,
) -> None:
    """Restore the trainable weights and optimizer state (both verified) from ``point``:
    this rank's shards of a point of shards (``ctx`` says which rank this is)."""
    state = json.loads((point.path / "state.json").read_text())
    if "ranks" in state:
        _load_shards(point, state, params=params, optimizer=optimizer, ctx=ctx)
        return
    weights_file = point.path / "weights.safetensors"
    if weights_file.is_file():
        if sha256_file(weights_file) != state.get("weights_sha256"):
            raise CheckpointError(f"weights in {point.path} do not match their sha256")
        weights = read_safetensors(weights_file)
    else:  # a tiny point of the earlier layout: a whole checkpoint
        weights = load_checkpoint(point.path / "checkpoint").state_dict
    _copy_weights(point, weights, params)
    optimizer_file = point.path / "optimizer.safetensors"
    if sha256_file(optimizer_file) != state.get("optimizer_sha256"):
        raise CheckpointError(f"optimizer state in {point.path} does not match its sha256")
    load_optimizer_state(optimizer, optimizer_file)


def _load_shards(
    point: ResumePoint,
    state: dict[str, Any],
    *,
    params: NamedParameters,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext | None,
) -> None:
    """This rank's shards of a point a sharded run of as many ranks wrote."""
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    if state["ranks"] != world or not any(isinstance(p, DTensor) for _, p in params):
        raise CheckpointError(
            f"resume point {point.path} holds the shards of {state['ranks']} ranks of a sharded "
            f"model; this job runs {world} rank(s) of a model "
            f"{'sharded' if any(isinstance(p, DTensor) for _, p in params) else 'not sharded'}: "
            "run it as the job that wrote it, or remove the state directory to start over"
        )
    files = state.get("files", {})
    names = (f"weights-rank-{rank:05d}.safetensors", f"optimizer-rank-{rank:05d}.safetensors")
    for name in names:
        if sha256_file(point.path / name) != files.get(name):
            raise CheckpointError(f"{name} in {point.path} does not match its sha256")
    _copy_weights(point, read_safetensors(point.path / names[0]), params)
    load_optimizer_state(optimizer, point.path / names[1])
    _shard_optimizer_state(optimizer)


def _copy_weights(
    point: ResumePoint, weights: dict[str, torch.Tensor], params: NamedParameters
) -> None:
    names = [name for name, _ in params]
    missing = sorted(set(names) - set(weights))
    if missing:
        raise CheckpointError(f"resume point {point.path} lacks weights {missing[:3]}")
    with torch.no_grad():
        for name, param in params:
            target = _local(param)
            target.copy_(weights[name].to(device=target.device, dtype=target.dtype))


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The loaded per-parameter state of sharded parameters as DTensors again, placed as
    their parameters (each rank loaded its own shard of it)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            slot = optimizer.state.get(param, {})
            for key, value in slot.items():
                plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                if plain and value.shape == param.to_local().shape:
                    slot[key] = DTensor.from_local(
                        value.to(param.device), param.device_mesh, param.placements
                    )
