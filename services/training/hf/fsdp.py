"""An hf model sharded over a job's ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``,
the engine that ships with torch): ``sharding: fsdp`` in the hyper-parameters.

Each rank keeps a shard of every weight, of its gradient and of the optimizer's state; a
block's full weights exist only while it runs. What it does, and why each piece is so:

- **Units.** Every block the model names in ``_no_split_modules`` (a decoder layer) is an
  FSDP unit of its own; the rest (embeddings, final norm, output head, tied or not) is the
  root's. A rank holds its shards plus the weights of the block running.
- **Loading, rank by rank.** The ranks load the verified checkpoint in turn (a barrier
  between), each onto the CPU in the dtype an unsharded run uses, attach the LoRA adapter
  (seeded alike on every rank, so a fresh adapter is the same everywhere), shard it (the
  rank keeps its own shard of each weight, the rest is freed) and move its shards to its
  device: a node holds at most one unsharded copy at a time, a GPU only shards.
- **Precision on CUDA**: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``:
  blocks are gathered and run in bf16, gradients reduced in fp32, and the sharded weights
  the optimizer steps stay as loaded (fp32 trainable weights; a LoRA base in bf16). On CPU
  (gloo) everything stays fp32.
- **Gradients are summed**: the trainers divide the loss by the global token count, so the
  reduce-scatter must sum, not average: every unit's divide factor is 1, with sum-only
  collectives (gloo has no pre-multiplied sum). The gradients are then exactly those of the
  unsharded run (tests/services/training/test_fsdp.py compares them).
- **Passes are collectives.** Every rank must run as many forward and backward passes as
  the others: the trainers pad with idle passes (:func:`services.training.family.
  idle_passes`), and a log-prob pass is one model call (no shared-prefix split, whose number
  of calls depends on the batch).
- **Rollouts.** Generating runs as many passes as the episodes need, different on every
  rank, so for local rollouts every unit is gathered once before and freed after
  (:meth:`ShardedModule.gathered`): each rank then holds the whole model for the rollout
  phase. A model too large for that rolls out on the remote backend (vLLM), and only the
  adapter is gathered to publish it.
- **Saving** gathers the weights one tensor at a time to the CPU (:meth:`ShardedModule.
  full_state`) and writes them in the usual format on rank 0: the same files, manifest and
  checkpoint id as the unsharded run's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

T = TypeVar("T")


class ShardedModule:
    """A module whose blocks and root were given to ``fully_shard``, and its FSDP units."""

    def __init__(self, module: Any, units: list[Any]) -> None:
        self.module = module
        self.units = units

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's full weights for the block (one all-gather per unit, the same on
        every rank), so that passes inside it are local: as many as each rank needs."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
            for unit in self.units:
                unit.set_reshard_after_forward(True, recurse=False)

    def full_state(self, *, every_rank: bool, trainable_only: bool = False) -> dict[str, Any]:
        """The module's state dict with full tensors on the CPU: on every rank, or on rank 0
        alone (the others get an empty dict). A collective: every rank must call it alike.
        Names that share one tensor (tied embeddings) share one gathered tensor, as in the
        unsharded module, so a save drops the alias the same way."""
        keep = every_rank or dist.get_rank() == 0
        trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
        gathered: dict[int, torch.Tensor] = {}
        state: dict[str, Any] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if trainable_only and name not in trainable:
                continue
            key = id(tensor)
            if key not in gathered:
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                gathered[key] = full.detach().to("cpu")
            if keep:
                state[name] = gathered[key]
        return state


def device_mesh(device: torch.device) -> Any:
    """The ranks as one data-parallel dimension on ``device``'s type. Every rank makes it at
    the same time (making it may be a collective), before any rank loads."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_module(module: Any, *, mesh: Any, device: torch.device) -> ShardedModule:
    """``fully_shard`` every block of ``module`` (an hf model, or a peft model around one)
    and then the module over ``mesh``, gradients summed over the ranks; ValueError for a
    model that names no blocks."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"cannot shard {type(base).__name__}: it names no blocks (_no_split_modules)"
        )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # per unit: the setting does not recurse
        unit.set_force_sum_reduction_for_comms(True)
    return ShardedModule(module, units)


def rank_by_rank(load: Callable[[], T]) -> T:
    """``load()`` on each rank in turn, a barrier between: a node holds one unsharded copy
    of the model at a time (each rank shards its copy before the next rank loads)."""
    result: T | None = None
    for turn in range(dist.get_world_size()):
        if dist.get_rank() == turn:
            result = load()
        dist.barrier()
    assert result is not None  # this rank's turn came
    return result


def sharding_active(sharding: str) -> bool:
    """Whether ``sharding`` shards this job: FSDP over more than one rank (with one rank
    there is nothing to shard, and the model trains as without it)."""
    return sharding == "fsdp" and dist.is_initialized() and dist.get_world_size() > 1
