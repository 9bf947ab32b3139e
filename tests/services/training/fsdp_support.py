"""What the FSDP tests run in each rank of a real process group (gloo, CPU), and the same
pass in one process to compare with.

One *pass* is the SFT step's forward and backward: a global batch of demonstrations split
round robin over the ranks, the loss summed over the batch's target tokens and divided by
their global count (the trainers' normaliser), micro-batches of one sequence (so the ranks
run different numbers of them and the sharded one pads with idle passes). The gradients are
gathered to full tensors and written by rank 0 with the loss, the checkpoint id a save of
the (unchanged) weights gives, and whether a resume point of shards restores the weights
and the optimizer's state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from services.environments.toolcalc import ToolcalcEnvironment
from services.training.checkpoint import safetensors_bytes
from services.training.config import HFSFTConfig
from services.training.distributed import DistContext, init_distributed, shutdown_distributed
from services.training.family import DemonstrationOptions, FamilyModel, collate, idle_passes
from services.training.hf.family import HFFamily
from services.training.optim import make_optimizer
from services.training.resume import latest_resume_point, load_resume_point, save_resume_point

SEQUENCES = 5  # odd: two ranks get 3 and 2 micro-batches


@dataclass(frozen=True)
class Case:
    """A pass to run: the checkpoint, LoRA or every weight, where rank 0 writes."""

    checkpoint: Path
    lora: bool
    out: Path
    port: int = 0


def load(case: Case, *, sharding: str) -> FamilyModel:
    torch.manual_seed(0)  # a fresh adapter's init, as the job seeds it
    config = HFSFTConfig(lora=case.lora, sharding=sharding)
    return HFFamily().load(case.checkpoint, device=torch.device("cpu"), training=config)


def demonstrations(model: FamilyModel) -> list[tuple[list[int], list[bool]]]:
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(SEQUENCES, seed=3, api_version="v1")
    return model.demonstrations(env, tasks, DemonstrationOptions(seed=0))[:SEQUENCES]


def one_pass(model: FamilyModel, ctx: DistContext) -> float:
    """This rank's share of the global batch, forward and backward; the loss over all ranks."""
    sequences = demonstrations(model)
    targets = float(sum(sum(mask[1:]) for _, mask in sequences))
    local = [sequences[i] for i in ctx.shard(len(sequences))]
    model.train()
    loss_sum = 0.0
    # how many passes the busiest rank runs: asked before any pass (each is a collective)
    idle = ctx.most(len(local)) - len(local) if getattr(model, "sharded", False) else 0
    for sequence in local:
        batch = collate([sequence], pad_id=model.pad_id, device=model.device)
        loss = -(model.logprobs(batch) * batch.target).sum() / targets
        loss.backward()
        loss_sum += float(loss.detach())
    idle_passes(model, idle, backward=True)
    params = [p for _, p in model.trainable_parameters()]
    ctx.all_reduce_grads(params)
    return ctx.all_reduce_sum([loss_sum])[0]


def full_gradients(model: FamilyModel) -> dict[str, torch.Tensor]:
    """Every trainable weight's gradient as a full tensor (a collective when sharded)."""
    grads = {}
    for name, param in model.trainable_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return grads


def write_result(out: Path, loss: float, grads: dict[str, torch.Tensor], **extra: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "grads.safetensors").write_bytes(safetensors_bytes(grads))
    (out / "result.json").write_text(json.dumps({"loss": loss, **extra}))


def sharded_rank(rank: int, world: int, case: Case) -> None:
    """One rank of the sharded pass (``torch.multiprocessing.spawn``'s target)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(case.port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", world_size=world, rank=rank, local_rank=rank)
    try:
        model = load(case, sharding="fsdp")
        checkpoint_id = model.save(case.out / "saved", parent=None, metadata={}).checkpoint_id
        loss = one_pass(model, ctx)
        grads = full_gradients(model)
        resumed = resume_round_trip(model, ctx, case.out / "state")
        if ctx.is_main:
            write_result(
                case.out,
                loss,
                grads,
                checkpoint_id=checkpoint_id,
                sharded=bool(getattr(model, "sharded", False)),
                resumed=resumed,
            )
        ctx.barrier()
    finally:
        shutdown_distributed()


def resume_round_trip(model: FamilyModel, ctx: DistContext, state_dir: Path) -> bool:
    """Step, write a resume point of shards, scribble over the weights and the optimizer,
    load the point back: whether every rank got back exactly what it wrote."""
    named = model.trainable_parameters()
    params = [p for _, p in named]
    optimizer = make_optimizer(params, lr=1e-3, weight_decay=0.0)
    optimizer.step()
    before = [_local(p).clone() for p in params]
    moments = [_local(optimizer.state[p]["exp_avg"]).clone() for p in params]
    save_resume_point(state_dir, step=1, params=named, optimizer=optimizer, counters={}, ctx=ctx)
    ctx.barrier()
    with torch.no_grad():
        for param in params:
            _local(param).add_(1.0)
    fresh = make_optimizer(params, lr=1e-3, weight_decay=0.0)
    point = latest_resume_point(state_dir)
    assert point is not None
    load_resume_point(point, params=named, optimizer=fresh, ctx=ctx)
    same = all(torch.equal(_local(p), b) for p, b in zip(params, before, strict=True)) and all(
        isinstance(fresh.state[p]["exp_avg"], DTensor) == isinstance(p, DTensor)
        and torch.equal(_local(fresh.state[p]["exp_avg"]), m)
        for p, m in zip(params, moments, strict=True)
    )
    return bool(ctx.all_reduce_sum([0.0 if same else 1.0])[0] == 0.0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def single_process(case: Case) -> None:
    """The same pass in this process, unsharded, written to ``case.out``."""
    model = load(case, sharding="none")
    ctx = init_distributed("cpu")
    checkpoint_id = model.save(case.out / "saved", parent=None, metadata={}).checkpoint_id
    loss = one_pass(model, ctx)
    write_result(case.out, loss, full_gradients(model), checkpoint_id=checkpoint_id)
