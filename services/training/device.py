"""Where tensors live and in which precision the model runs.

CUDA runs the model under bf16 autocast (weights and optimizer state stay fp32), CPU runs
plain fp32: CPU bf16 matmuls are slower than fp32 on most hosts and the reference policy is
small enough that fp32 costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


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
