"""Where tensors live and in which precision the model runs.

CUDA runs the model under bf16 autocast (weights and optimizer state stay fp32), CPU runs
plain fp32: CPU bf16 matmuls are slower than fp32 on most hosts and the reference policy is
small enough that fp32 costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

logger = logging.getLogger(__name__)


class DeviceError(ValueError):
    """A device name that cannot be used on this host."""


def resolve_device(name: str = "auto", *, local_rank: int = 0) -> torch.device:
    """``auto`` means CUDA when present, else CPU; ``cuda`` on a host without it is an error."""
    if name not in DEVICE_CHOICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' was requested but CUDA is not available")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))


@contextlib.contextmanager
def autocast(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA, a no-op elsewhere."""
    if device.type == "cuda":
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def use_threads(threads: int | None) -> None:
    """Run torch's intra-op and inter-op pools at ``threads`` (a job's ``threads`` setting),
    so a job beside a model server takes only its share of the cores; None keeps torch's
    defaults (``OMP_NUM_THREADS``, which the local executor sets to the job's share).

    The inter-op pool can be sized only before torch first uses it; a process that already
    has (a test running jobs in-process) keeps its pool and says so in the log line."""
    if threads is not None:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            logger.debug("torch's inter-op pool was already started; it keeps its size")
    start_thread_pool()
    logger.info(
        "torch threads: %d intra-op, %d inter-op",
        torch.get_num_threads(),
        torch.get_num_interop_threads(),
    )


def start_thread_pool() -> None:
    """Run one parallel operation, so the model's first call splits its work as every later
    one does.

    The first parallel region of a process can split an elementwise operation at other
    boundaries than the later ones (its thread team is still starting), and where a split
    falls decides which elements the vectorized and which the scalar code computes: the
    last bits of, e.g., a rotary embedding's cosines. Measured here (2 threads): a fresh
    process's first forward of a one-row prompt through a tiny Llama gave other cosines in
    9 of 150 processes, and none of 80 that ran one parallel operation first; a job's
    checkpoint id (the hash of its weights) must be the same in every process."""
    torch.cos(torch.arange(1 << 16, dtype=torch.float32))
