"""The checkpoint manifest: reading, verifying and writing it, with the standard library only.

A checkpoint's trust rests on its ``manifest.json`` (see :mod:`services.training.checkpoint`
for the directory layout): the sha256 and size of every file, the parent, the family and
kind, and for a LoRA adapter the base it applies to. Everything that only needs to check a
checkpoint (the api registering a first champion, the worker installing a run's output,
``ratchet checkpoint verify``) reads this module and never imports torch, so the api process
stays free of it; loading weights is :mod:`services.training.checkpoint`'s job.

Files are read as job output is read everywhere: only the files the manifest lists, each
opened with ``O_NOFOLLOW`` after an ``lstat`` that shows a regular file, never a symlink
(a job could plant ``x -> /proc/self/environ`` and have the worker copy its secrets), and
pickle weights (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``) are refused by name.

Nor does a checkpoint carry code: Python sources and bytecode, import hooks (``.pth``,
``sitecustomize``, ``usercustomize``), native libraries (``.so``, ``.dylib``, ``.dll``) and
files with an executable bit are refused wherever a checkpoint is written, verified,
installed or loaded (:func:`refuse_unsafe_file`). A checkpoint directory is mounted into
model servers and put on paths by a serving target; a file there that an interpreter would
import is code run with whatever credentials that process holds. Ratchet never runs a
checkpoint's own code (``trust_remote_code`` stays off), so nothing legitimate is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_SCHEMA = "ratchet.checkpoint/v1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
CONTENT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)


FAMILIES = ("tiny", "hf")
KINDS = ("full", "lora")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Files an interpreter or a dynamic loader would run: sources, bytecode, import hooks, native
# libraries (``libx.so.1`` too), scripts and executables.
CODE_SUFFIXES = (
    ".py",
    ".pyc",
    ".pyo",
    ".pyd",
    ".pyw",
    ".pyz",
    ".pth",
    ".so",
    ".dylib",
    ".dll",
    ".exe",
    ".sh",
    ".egg",
    ".whl",
)
IMPORT_HOOK_STEMS = ("sitecustomize", "usercustomize")


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, or whose bytes do not match its manifest."""


@dataclass(frozen=True)
class BaseRef:
    """The full checkpoint a LoRA adapter applies to: its content id and sha256.

    For checkpoints written by Ratchet the two are equal (the id is a sha256 over the base's
    file hashes); both are kept so a reader can check the base without knowing that.
    """

    checkpoint_id: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        return {"checkpoint_id": self.checkpoint_id, "sha256": self.sha256}


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says: the id, each file's hash, the parent, metadata."""

    checkpoint_id: str
    files: dict[str, FileEntry]
    parent: str | None = None
    format: str = "safetensors"
    metadata: dict[str, Any] = field(default_factory=dict)
    family: str = "tiny"
    kind: str = "full"
    base: BaseRef | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": MANIFEST_SCHEMA,
            "checkpoint_id": self.checkpoint_id,
            "format": self.format,
            "parent": self.parent,
            "files": {
                name: {"sha256": entry.sha256, "size": entry.size}
                for name, entry in sorted(self.files.items())
            },
            "metadata": self.metadata,
        }
        if self.family != "tiny":  # tiny manifests keep their original shape
            data["family"] = self.family
            data["kind"] = self.kind
            data["base"] = self.base.to_dict() if self.base else None
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise CheckpointError(f"manifest schema must be {MANIFEST_SCHEMA!r}")
        files = data.get("files")
        if not isinstance(files, dict):
            raise CheckpointError("manifest has no 'files' object")
        entries: dict[str, FileEntry] = {}
        for name, entry in files.items():
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("sha256"), str)
                or not isinstance(entry.get("size"), int)
            ):
                raise CheckpointError(f"manifest entry for {name!r} needs sha256 and size")
            entries[str(name)] = FileEntry(sha256=entry["sha256"], size=entry["size"])
        parent = data.get("parent")
        metadata = data.get("metadata") or {}
        if not isinstance(data.get("checkpoint_id"), str):
            raise CheckpointError("manifest has no checkpoint_id")
        family = data.get("family", "tiny")
        if family not in FAMILIES:
            raise CheckpointError(f"manifest family must be one of {FAMILIES}, got {family!r}")
        kind = data.get("kind", "full")
        if kind not in KINDS:
            raise CheckpointError(f"manifest kind must be one of {KINDS}, got {kind!r}")
        base = _base_ref(data.get("base"))
        if kind == "lora" and base is None:
            raise CheckpointError("a LoRA adapter manifest must name its base checkpoint")
        return cls(
            checkpoint_id=data["checkpoint_id"],
            files=entries,
            parent=parent if isinstance(parent, str) else None,
            format=str(data.get("format", "safetensors")),
            metadata=metadata if isinstance(metadata, dict) else {},
            family=family,
            kind=kind,
            base=base,
        )


def _base_ref(raw: Any) -> BaseRef | None:
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("checkpoint_id"), str)
        or not isinstance(raw.get("sha256"), str)
    ):
        raise CheckpointError("manifest 'base' must be {checkpoint_id: str, sha256: str}")
    return BaseRef(checkpoint_id=raw["checkpoint_id"], sha256=raw["sha256"])


def open_regular_file(path: Path) -> int:
    """A read-only descriptor for ``path`` if it is a regular file, never through a symlink."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint file {path.name} is missing from {path.parent}"
        ) from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(
            f"checkpoint file {path.name} in {path.parent} is a symlink (refused)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"checkpoint file {path.name} in {path.parent} is not a regular file")
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between lstat and open
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path.name} in {path.parent} is not a regular file")
    return fd


def read_regular_bytes(path: Path) -> bytes:
    """The bytes of a regular file (see :func:`open_regular_file`)."""
    with os.fdopen(open_regular_file(path), "rb") as fh:
        return fh.read()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_regular_file(path), "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_id_from_hashes(hashes: dict[str, str], *, base_id: str | None = None) -> str:
    """sha256 over ``"<sha256>  <name>\\n"`` lines of the content files, in name order.

    An adapter's base id enters as one more line, ``"<base id>  <base>\\n"``.
    """
    lines = "".join(f"{hashes[name]}  {name}\n" for name in sorted(hashes))
    if base_id is not None:
        lines += f"{base_id}  <base>\n"
    return hashlib.sha256(lines.encode()).hexdigest()


def refuse_pickle(name: str, where: Path | str) -> None:
    """Pickle weights can run code when loaded: refused by name, with what to do instead."""
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{name} in {where} is a pickle file; Ratchet loads weights only from safetensors "
            "(convert it, e.g. model.save_pretrained(dir, safe_serialization=True))"
        )


def refuse_unsafe_file(name: str, where: Path | str, mode: int | None = None) -> None:
    """Refuse a file no checkpoint may hold: pickle weights (:func:`refuse_pickle`), code or
    an import hook (by name), or a file with an executable bit (``mode``, from ``lstat``)."""
    lowered = name.lower()
    stem = lowered.split(".", 1)[0]
    suffixes = [f".{part}" for part in lowered.split(".")[1:]]
    native = any(suffix in (".so", ".dylib", ".dll") for suffix in suffixes)
    if stem in IMPORT_HOOK_STEMS or lowered.endswith(CODE_SUFFIXES) or native:
        raise CheckpointError(
            f"{name} in {where} is code or an import hook; a checkpoint holds weights, config "
            "and tokenizer files only (Ratchet never runs a checkpoint's code): remove it"
        )
    refuse_pickle(name, where)
    if mode is not None and mode & 0o111:
        raise CheckpointError(
            f"{name} in {where} is executable (mode {stat.S_IMODE(mode):o}); a checkpoint holds "
            f"no programs: `chmod a-x` it if it is data"
        )


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n")


def read_manifest(checkpoint_dir: Path | str) -> Manifest:
    path = Path(checkpoint_dir) / MANIFEST_FILE
    if not path.is_file() and not path.is_symlink():
        raise CheckpointError(f"{checkpoint_dir} is not a checkpoint: {MANIFEST_FILE} is missing")
    try:
        data = json.loads(read_regular_bytes(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return Manifest.from_dict(data)


def required_files(manifest: Manifest) -> tuple[str, ...]:
    """The files a checkpoint of this family and kind cannot do without."""
    if manifest.family == "tiny":
        return CONTENT_FILES
    if manifest.kind == "lora":
        return ("adapter_config.json", "adapter_model.safetensors")
    return (CONFIG_FILE,)


def verify_checkpoint(checkpoint_dir: Path | str, *, expected_id: str | None = None) -> Manifest:
    """Re-hash every file named in the manifest; raise :class:`CheckpointError` on any mismatch."""
    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    missing = [name for name in required_files(manifest) if name not in manifest.files]
    if missing:
        raise CheckpointError(f"manifest of {root} does not list {', '.join(missing)}")
    if manifest.family == "hf" and not any(n.endswith(".safetensors") for n in manifest.files):
        raise CheckpointError(f"manifest of {root} lists no .safetensors weights")
    _refuse_unlisted_code(root, manifest)
    for name, entry in sorted(manifest.files.items()):
        if Path(name).name != name or name in (MANIFEST_FILE, ".", ".."):
            raise CheckpointError(f"manifest of {root} lists {name!r}, which is not a file name")
        refuse_unsafe_file(name, root, _lstat_mode(root / name))
        actual = sha256_file(root / name)
        if actual != entry.sha256:
            raise CheckpointError(
                f"checkpoint file {name} in {root} has sha256 {actual[:12]}…, "
                f"manifest says {entry.sha256[:12]}… (tampered or corrupt)"
            )
    if manifest.family == "tiny":
        hashes = {n: manifest.files[n].sha256 for n in CONTENT_FILES}
        computed = checkpoint_id_from_hashes(hashes)
    else:
        hashes = {n: e.sha256 for n, e in manifest.files.items()}
        base_id = manifest.base.checkpoint_id if manifest.base else None
        computed = checkpoint_id_from_hashes(hashes, base_id=base_id)
    if computed != manifest.checkpoint_id:
        raise CheckpointError(f"manifest of {root} has checkpoint_id that does not match its files")
    if expected_id is not None and expected_id != manifest.checkpoint_id:
        raise CheckpointError(
            f"checkpoint {root} is {manifest.checkpoint_id[:12]}…, expected {expected_id[:12]}…"
        )
    return manifest


def _refuse_unlisted_code(root: Path, manifest: Manifest) -> None:
    """Code beside a checkpoint is refused too, listed or not: the directory is what a model
    server mounts, and an interpreter imports ``sitecustomize.py`` (or a ``sitecustomize/``
    package) from a directory on its path whether a manifest names it or not."""
    try:
        entries = sorted(entry.name for entry in os.scandir(root))
    except OSError as exc:
        raise CheckpointError(f"cannot list {root}: {exc.strerror or exc}") from None
    for name in entries:
        if name in manifest.files or name == MANIFEST_FILE:
            continue
        try:
            refuse_unsafe_file(name, root)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (it is not in the manifest either)") from None


def _lstat_mode(path: Path) -> int | None:
    """The mode of ``path`` itself; None when it is absent (opening it says so)."""
    try:
        return path.lstat().st_mode
    except FileNotFoundError:
        return None


def verify_family(
    checkpoint_dir: Path | str, family: str, *, expected_id: str | None = None
) -> Manifest:
    """The verified manifest of a checkpoint directory that a ``family`` loader can read."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    manifest = verify_checkpoint(root, expected_id=expected_id)
    if manifest.family != family:
        raise CheckpointError(
            f"checkpoint {root} is of the {manifest.family!r} family, not {family}"
        )
    return manifest


def checkpoint_files(directory: Path) -> list[str]:
    """The files a manifest of ``directory`` lists: its regular top-level files.

    Hidden entries (``.gitattributes``, ``.cache/``) and an existing ``manifest.json`` are
    left out. Symlinks, sub-directories, other non-regular files, pickle weights, code and
    executables are refused: a checkpoint is a flat directory of plain data files, and what
    it holds is exactly what its manifest says.
    """
    if not directory.is_dir() or directory.is_symlink():
        raise CheckpointError(f"{directory} is not a directory")
    names: list[str] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == MANIFEST_FILE:
            continue
        if entry.is_symlink():
            raise CheckpointError(f"{entry.name} in {directory} is a symlink (refused)")
        if entry.is_dir(follow_symlinks=False):
            raise CheckpointError(
                f"{entry.name} in {directory} is a directory; a checkpoint is a flat directory"
            )
        if not entry.is_file(follow_symlinks=False):
            raise CheckpointError(f"{entry.name} in {directory} is not a regular file")
        refuse_unsafe_file(entry.name, directory, entry.stat(follow_symlinks=False).st_mode)
        names.append(entry.name)
    return names


def write_manifest(
    directory: Path | str,
    *,
    family: str,
    kind: str = "full",
    base: BaseRef | None = None,
    parent: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    """Hash every file of a checkpoint directory and write its ``manifest.json``.

    This is how a directory written by any trainer (Ratchet's, TRL's, a user's script)
    becomes a checkpoint Ratchet can verify: ``ratchet checkpoint manifest DIR`` calls it.
    """
    root = Path(directory)
    if family not in FAMILIES or kind not in KINDS:
        raise CheckpointError(f"family must be one of {FAMILIES} and kind one of {KINDS}")
    if kind == "lora" and base is None:
        raise CheckpointError("a LoRA adapter checkpoint must name its base checkpoint")
    names = checkpoint_files(root)
    files = {
        name: FileEntry(sha256=sha256_file(root / name), size=(root / name).stat().st_size)
        for name in names
    }
    if family == "tiny":
        missing = [n for n in CONTENT_FILES if n not in files]
        if missing:
            raise CheckpointError(f"{root} lacks {', '.join(missing)} for a tiny checkpoint")
        checkpoint_id = checkpoint_id_from_hashes({n: files[n].sha256 for n in CONTENT_FILES})
    else:
        checkpoint_id = checkpoint_id_from_hashes(
            {n: e.sha256 for n, e in files.items()},
            base_id=base.checkpoint_id if base else None,
        )
    manifest = Manifest(
        checkpoint_id=checkpoint_id,
        files=files,
        parent=parent,
        metadata=dict(metadata or {}),
        family=family,
        kind=kind,
        base=base,
    )
    missing = [n for n in required_files(manifest) if n not in files]
    if missing:
        raise CheckpointError(f"{root} lacks {', '.join(missing)} for a {family} {kind} checkpoint")
    if family == "hf" and not any(n.endswith(".safetensors") for n in files):
        raise CheckpointError(f"{root} holds no .safetensors weights")
    write_json(root / MANIFEST_FILE, manifest.to_dict())
    return manifest
