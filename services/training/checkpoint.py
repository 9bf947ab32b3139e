"""The checkpoint format: a directory to verify, load without pickle and address by content.

A checkpoint directory holds

- ``model.safetensors`` — the weights (fp32, tensors sorted by name, so equal weights give
  equal bytes),
- ``config.json`` — the model configuration,
- ``tokenizer.json`` — the tokenizer description,
- ``manifest.json`` — sha256 and size of each file above, the parent checkpoint id and
  free-form metadata.

The checkpoint id is the sha256 of the lines ``"<sha256>  <file>\\n"`` (sha256sum's format)
for the three content files in name order: equal weights, config and tokenizer give the
same id wherever and whenever they were written, and the manifest's metadata (step, time)
does not change it. :func:`load_checkpoint` re-hashes every file and refuses a checkpoint
whose bytes do not match its manifest.

That is the ``tiny`` family. The same manifest describes ``hf`` checkpoints (any
transformers causal LM directory, see :mod:`services.training.hf.checkpoint`): it then
carries ``"family": "hf"``, ``"kind": "full"`` or ``"lora"`` and, for a LoRA adapter,
``"base": {"checkpoint_id", "sha256"}`` naming the full model it applies to; the id hashes
every listed file (and the base's id, so one adapter on two bases is two models).

The manifest itself (reading, verifying, writing) lives in
:mod:`services.training.checkpoint_manifest`, which needs no torch, so processes that only
check checkpoints (the api) never import it; its names are re-exported here for the jobs.

The safetensors file is written here rather than by ``safetensors.torch.save_file``, which
needs numpy; the format is a length-prefixed JSON header followed by raw little-endian
bytes. Loading goes through the safetensors library itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as safetensors_load
from torch.distributed.tensor import DTensor

from services.training.checkpoint_manifest import (
    CONFIG_FILE,
    CONTENT_FILES,
    FAMILIES,
    KINDS,
    MANIFEST_FILE,
    MANIFEST_SCHEMA,
    PICKLE_SUFFIXES,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    BaseRef,
    CheckpointError,
    FileEntry,
    Manifest,
    checkpoint_files,
    checkpoint_id_from_hashes,
    open_regular_file,
    read_manifest,
    read_regular_bytes,
    refuse_pickle,
    required_files,
    sha256_file,
    verify_checkpoint,
    verify_family,
    write_json,
    write_manifest,
)
from services.training.tokenizer import ByteTokenizer, TokenizerError

__all__ = [
    "CONFIG_FILE",
    "CONTENT_FILES",
    "FAMILIES",
    "KINDS",
    "MANIFEST_FILE",
    "MANIFEST_SCHEMA",
    "PICKLE_SUFFIXES",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "BaseRef",
    "CheckpointError",
    "FileEntry",
    "HasConfigDict",
    "LoadedCheckpoint",
    "Manifest",
    "checkpoint_files",
    "checkpoint_id_from_hashes",
    "load_checkpoint",
    "load_optimizer_state",
    "open_regular_file",
    "read_manifest",
    "read_regular_bytes",
    "read_safetensors",
    "refuse_pickle",
    "required_files",
    "safetensors_bytes",
    "save_checkpoint",
    "save_optimizer_state",
    "sha256_file",
    "verify_checkpoint",
    "verify_family",
    "write_manifest",
]

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class HasConfigDict(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint in memory: weights, config dict, tokenizer and manifest."""

    path: Path
    manifest: Manifest
    config: dict[str, Any]
    tokenizer: ByteTokenizer
    state_dict: dict[str, torch.Tensor]


def safetensors_bytes(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    """Serialize tensors in the safetensors format, deterministically (names sorted)."""
    if sys.byteorder != "little":
        raise CheckpointError("writing safetensors requires a little-endian host")
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        blob = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        blobs.append(blob)
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(blobs)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file (no pickle); tensors are copied out of the file buffer."""
    data = read_regular_bytes(path)
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # the Rust loader raises its own error types
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return {name: tensor.clone() for name, tensor in tensors.items()}


def _prepare_target(out_dir: Path) -> Path:
    """A fresh temp directory beside ``out_dir``; ``out_dir`` itself must be absent or empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"checkpoint directory {out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    model: torch.nn.Module,
    config: HasConfigDict,
    out_dir: Path | str,
    *,
    parent: str | Manifest | None = None,
    tokenizer: ByteTokenizer | None = None,
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    """Write ``model`` as a checkpoint directory and return its manifest.

    The directory is assembled beside ``out_dir`` and renamed into place, so a reader (or a
    run killed mid-write) never sees half a checkpoint.
    """
    out_dir = Path(out_dir)
    tmp = _prepare_target(out_dir)
    tokenizer = tokenizer or ByteTokenizer()
    state = {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in model.state_dict().items()
    }
    (tmp / WEIGHTS_FILE).write_bytes(safetensors_bytes(state, {"format": "pt"}))
    write_json(tmp / CONFIG_FILE, config.to_dict())
    tokenizer.save(tmp / TOKENIZER_FILE)
    files = {
        name: FileEntry(sha256=sha256_file(tmp / name), size=(tmp / name).stat().st_size)
        for name in CONTENT_FILES
    }
    manifest = Manifest(
        checkpoint_id=checkpoint_id_from_hashes({n: e.sha256 for n, e in files.items()}),
        files=files,
        parent=parent.checkpoint_id if isinstance(parent, Manifest) else parent,
        metadata=dict(metadata or {}),
    )
    write_json(tmp / MANIFEST_FILE, manifest.to_dict())
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return manifest


def load_checkpoint(
    checkpoint_dir: Path | str, *, expected_id: str | None = None
) -> LoadedCheckpoint:
    """Verify and load a checkpoint directory (weights via safetensors, never pickle)."""
    root = Path(checkpoint_dir)
    manifest = verify_family(root, "tiny", expected_id=expected_id)
    try:
        config = json.loads(read_regular_bytes(root / CONFIG_FILE))
        tokenizer = ByteTokenizer.load(root / TOKENIZER_FILE)
    except (json.JSONDecodeError, UnicodeDecodeError, TokenizerError) as exc:
        raise CheckpointError(f"checkpoint {root}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {root}: {CONFIG_FILE} is not a JSON object")
    state = read_safetensors(root / WEIGHTS_FILE)
    return LoadedCheckpoint(root, manifest, config, tokenizer, state)


def save_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """AdamW-style optimizer state as safetensors + JSON param groups (no pickle); the
    state of a sharded (DTensor) parameter is this rank's shard of it."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    for index, slot in state_dict["state"].items():
        for key, value in slot.items():
            if isinstance(value, DTensor):  # a sharded model's: this rank's shard
                tensors[f"{index}.{key}"] = value.to_local()
            elif isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = float(value)
    groups = state_dict["param_groups"]
    metadata = {"param_groups": json.dumps(groups, sort_keys=True), "scalars": json.dumps(scalars)}
    path.write_bytes(safetensors_bytes(tensors, metadata))


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Inverse of :func:`save_optimizer_state`."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    metadata = header.get("__metadata__", {})
    tensors = read_safetensors(path)
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for index, values in json.loads(metadata.get("scalars", "{}")).items():
        state.setdefault(int(index), {}).update(values)
    groups = json.loads(metadata["param_groups"])
    for group in groups:  # JSON has no tuples; torch's optimizers keep betas as one
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
