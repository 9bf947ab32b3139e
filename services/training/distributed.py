"""Data parallelism across ``torchrun`` processes: gloo on CPU, nccl on CUDA.

The trainers split each *global* batch across ranks, every rank computes the loss of its
share divided by the *global* token count, and gradients are summed across ranks before
clipping and the optimizer step. The update is therefore the one a single process would
make on the whole global batch (up to float summation order), whatever the world size.
Gradients are summed with explicit ``all_reduce`` calls rather than through the DDP
wrapper, which averages (wrong normaliser for token-level losses) and hides when the
communication happens.

A model sharded with FSDP2 (``sharding: fsdp``, :mod:`services.training.hf.fsdp`) holds its
parameters as DTensors: its backward already sums their gradients over the ranks
(reduce-scatter, divide factor 1), so :meth:`DistContext.all_reduce_grads` and
:meth:`DistContext.broadcast_parameters` leave DTensors alone. Its forward and backward are
collectives, so every rank must run as many of them as the others: a trainer asks
:meth:`DistContext.most` (before its first pass) how many micro-batches the busiest rank has
and runs :func:`services.training.family.idle_passes` for the rest (:func:`is_sharded` says
when it must).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from services.training.device import DeviceError, resolve_device
from services.training.jobspec import JobError, job_environment

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job: rank, world size and device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shard(self, n: int) -> list[int]:
        """Positions ``0..n-1`` of a global batch that this rank handles (round robin)."""
        return list(range(self.rank, n, self.world_size))

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers across ranks (float64, so integer counts stay exact)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) for v in tensor.cpu().tolist()]

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """The largest of each number across ranks."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [float(v) for v in tensor.cpu().tolist()]

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (every rank learns the same answer)."""
        return self.all_reduce_max([1.0 if flag else 0.0])[0] > 0.0

    def most(self, count: int) -> int:
        """The largest ``count`` of any rank (how many passes the busiest rank runs)."""
        return int(self.all_reduce_max([float(count)])[0])

    def per_rank(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order (each rank fills its own slot of a sum)."""
        slots = [0.0] * self.world_size
        slots[self.rank] = value
        return self.all_reduce_sum(slots)

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient across ranks (a missing gradient counts as zero);
        a sharded (DTensor) parameter's gradient is already the sum, from FSDP's backward."""
        if not self.distributed:
            return
        for param in params:
            if isinstance(param, DTensor):
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def broadcast_parameters(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make every rank start from rank 0's trainable weights (the frozen ones are loaded
        from the same verified checkpoint everywhere). A sharded parameter is left alone:
        each rank holds its own shard of weights made the same on every rank before
        sharding."""
        if not self.distributed:
            return
        for param in params:
            if not isinstance(param, DTensor):
                dist.broadcast(param.data, src=0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def is_sharded(model: object) -> bool:
    """Whether ``model`` is sharded over the ranks (its passes are collectives)."""
    return bool(getattr(model, "sharded", False))


def peak_memory(ctx: DistContext) -> dict[str, object]:
    """Each rank's peak memory, for metrics.json (every rank must call it: it is a
    collective). On CUDA the most the caching allocator held for tensors
    (``max_memory_allocated``); on CPU the process's peak resident set."""
    if ctx.device.type == "cuda":
        kind, value = "cuda_max_allocated", float(torch.cuda.max_memory_allocated(ctx.device))
    else:
        import resource

        kind, value = "max_rss", float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"kind": kind, "bytes": [int(v) for v in ctx.per_rank(value)]}


def init_distributed(
    device_name: str,
    *,
    world_size: int = 1,
    rank: int = 0,
    local_rank: int = 0,
    local_world_size: int = 1,
) -> DistContext:
    """Join the process group when ``world_size > 1`` (``torchrun`` sets the rendezvous env)."""
    device = resolve_device(device_name, local_rank=local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=backend_for(device, local_world_size),
            init_method="env://",
            world_size=world_size,
            rank=rank,
        )
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def backend_for(device: torch.device, local_world_size: int = 1) -> str:
    """nccl on CUDA, gloo on the CPU, and gloo where this node runs more ranks than it has
    GPUs (ranks share one: NCCL refuses two ranks on one device; a test's or a benchmark's
    layout, far slower than one rank per GPU)."""
    if device.type != "cuda":
        return "gloo"
    if local_world_size > torch.cuda.device_count():
        logger.warning(
            "%d ranks share %d GPU(s): the process group runs on gloo (NCCL takes one rank "
            "per GPU)",
            local_world_size,
            torch.cuda.device_count(),
        )
        return "gloo"
    return "nccl"


def init_job_distributed(device_name: str) -> DistContext:
    """:func:`init_distributed` with a job's torchrun ranks; a device it lacks is a JobError."""
    job_env = job_environment()
    try:
        return init_distributed(
            device_name,
            world_size=job_env.world_size,
            rank=job_env.rank,
            local_rank=job_env.local_rank,
            local_world_size=job_env.local_world_size,
        )
    except DeviceError as exc:
        raise JobError(str(exc)) from None


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
