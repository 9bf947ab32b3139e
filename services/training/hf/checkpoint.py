"""``hf`` checkpoints: a transformers model directory or a peft LoRA adapter, with a manifest.

Exact files of a **full** checkpoint (what ``save_pretrained`` writes, safetensors only):
``config.json``, ``generation_config.json`` (when the model has one), ``model.safetensors``
or ``model-0000N-of-0000M.safetensors`` shards with ``model.safetensors.index.json``, the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``, optionally
``special_tokens_map.json``) with the chat template (``chat_template.jinja`` or inside
``tokenizer_config.json``), and ``manifest.json``.

A **LoRA adapter** checkpoint holds ``adapter_config.json`` and
``adapter_model.safetensors`` (peft's files; ``base_model_name_or_path`` is rewritten to
``ratchet:<base id>`` so the bytes do not depend on where the base lay) and a manifest with
``"kind": "lora"`` and ``"base": {"checkpoint_id", "sha256"}``. The base is found beside the
adapter in the content-addressed store (``checkpoints/<base id>``) or passed explicitly,
and is verified against the id before use. An adapter trained from an adapter champion
continues that adapter, so an adapter's base is always a full checkpoint, never a chain.

Loading verifies every file against the manifest first and passes ``use_safetensors=True``
and ``local_files_only=True``: pickle weights are refused (the manifest refuses them by
name too), nothing is fetched from a hub, and ``trust_remote_code`` stays off.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.training.checkpoint import (
    MANIFEST_FILE,
    BaseRef,
    CheckpointError,
    Manifest,
    read_regular_bytes,
    verify_checkpoint,
    verify_family,
    write_manifest,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_EXTRAS = ("README.md",)  # peft writes a model card; it is not part of the checkpoint


@dataclass
class LoadedHF:
    """A verified hf checkpoint in memory (the model may be a peft model)."""

    model: Any
    tokenizer: Any
    manifest: Manifest
    base_manifest: Manifest | None
    path: Path


def save_hf_checkpoint(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    *,
    parent: str | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_size: str = "2GB",
    state_dict: dict[str, Any] | None = None,
) -> Manifest:
    """Save a full transformers model + tokenizer as an hf checkpoint (fp32 safetensors);
    ``state_dict`` holds the weights when the module's own are shards (FSDP)."""
    tmp = _fresh_dir(out_dir)
    model.save_pretrained(tmp, max_shard_size=max_shard_size, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    manifest = write_manifest(tmp, family="hf", kind="full", parent=parent, metadata=metadata)
    _move_into_place(tmp, out_dir)
    return manifest


def save_lora_adapter(
    peft_model: Any,
    out_dir: Path,
    *,
    base: Manifest,
    parent: str | None = None,
    metadata: dict[str, Any] | None = None,
    state_dict: dict[str, Any] | None = None,
) -> Manifest:
    """Save a peft model's adapter as a LoRA checkpoint naming ``base`` (a full checkpoint);
    ``state_dict`` holds the weights when the module's own are shards (FSDP)."""
    if base.kind != "full":
        raise CheckpointError("a LoRA adapter's base must be a full checkpoint")
    tmp = _fresh_dir(out_dir)
    peft_model.save_pretrained(tmp, state_dict=state_dict)
    for extra in _PEFT_EXTRAS:
        (tmp / extra).unlink(missing_ok=True)
    config_path = tmp / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = f"ratchet:{base.checkpoint_id}"
    # peft keeps target_modules as a set and writes it in hash order, which differs per
    # process (PYTHONHASHSEED): sorted, the same training gives the same checkpoint id.
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, sort_keys=True, indent=2) + "\n")
    ref = BaseRef(checkpoint_id=base.checkpoint_id, sha256=base.checkpoint_id)
    manifest = write_manifest(
        tmp, family="hf", kind="lora", base=ref, parent=parent, metadata=metadata
    )
    _move_into_place(tmp, out_dir)
    return manifest


def resolve_base_dir(adapter_dir: Path, manifest: Manifest, base_dir: Path | None) -> Path:
    """Where an adapter's base lies: ``base_dir`` if given, else ``<store>/<base id>``."""
    if manifest.base is None:
        raise CheckpointError(f"{adapter_dir} is not a LoRA adapter checkpoint")
    candidate = base_dir or adapter_dir.parent / manifest.base.checkpoint_id
    if not candidate.is_dir():
        raise CheckpointError(
            f"base checkpoint {manifest.base.checkpoint_id[:12]}… of adapter {adapter_dir} "
            f"not found at {candidate}"
        )
    return candidate


def load_hf_checkpoint(
    path: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    base_dir: Path | None = None,
    trainable_adapter: bool = False,
    expected_id: str | None = None,
) -> LoadedHF:
    """Verify and load an hf checkpoint (a LoRA adapter is loaded onto its verified base)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    manifest = verify_family(root, "hf", expected_id=expected_id)
    base_manifest = None
    model_dir = root
    if manifest.kind == "lora":
        model_dir = resolve_base_dir(root, manifest, base_dir)
        assert manifest.base is not None
        base_manifest = verify_checkpoint(model_dir, expected_id=manifest.base.checkpoint_id)
        if base_manifest.family != "hf" or base_manifest.kind != "full":
            raise CheckpointError(f"base of adapter {root} must be a full hf checkpoint")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, use_safetensors=True, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load hf checkpoint {model_dir}: {exc}") from exc
    result: Any = model
    if manifest.kind == "lora":
        result = _attach_adapter(model, root, trainable=trainable_adapter)
    return LoadedHF(
        model=result.to(device),
        tokenizer=tokenizer,
        manifest=manifest,
        base_manifest=base_manifest,
        path=root,
    )


def _attach_adapter(model: Any, adapter_dir: Path, *, trainable: bool) -> Any:
    from peft import LoraConfig, PeftModel, set_peft_model_state_dict
    from safetensors.torch import load as safetensors_load

    try:
        config_data = json.loads(read_regular_bytes(adapter_dir / ADAPTER_CONFIG))
        config_data.pop("base_model_name_or_path", None)
        if config_data.get("peft_type", "LORA") != "LORA":
            raise CheckpointError(f"adapter {adapter_dir} is not a LoRA adapter")
        known = set(LoraConfig.__dataclass_fields__)
        config = LoraConfig(**{k: v for k, v in config_data.items() if k in known})
        config.inference_mode = not trainable
        peft_model = PeftModel(model, config)
        weights = safetensors_load(read_regular_bytes(adapter_dir / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(peft_model, weights)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot load LoRA adapter {adapter_dir}: {exc}") from exc
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise CheckpointError(
            f"LoRA adapter {adapter_dir} has weights its base does not fit: {unexpected[:3]}"
        )
    if trainable:
        for name, param in peft_model.named_parameters():
            param.requires_grad = "lora_" in name
    else:
        peft_model.eval()
    return peft_model


def merge_adapter(adapter_dir: Path, out_dir: Path, *, base_dir: Path | None = None) -> Manifest:
    """Fold a LoRA adapter into its base and save the result as a full checkpoint."""
    loaded = load_hf_checkpoint(adapter_dir, base_dir=base_dir)
    merged = loaded.model.merge_and_unload()
    return save_hf_checkpoint(
        merged,
        loaded.tokenizer,
        out_dir,
        parent=loaded.manifest.checkpoint_id,
        metadata={"merged_from": loaded.manifest.checkpoint_id},
    )


def _fresh_dir(out_dir: Path) -> Path:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"checkpoint directory {out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.writing")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if not (tmp / MANIFEST_FILE).is_file():
        raise CheckpointError(f"internal: {tmp} has no manifest")
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
