"""Pin the images' Python dependencies, with hashes, for pip's hash-checking mode.

Writes three files beside this script, each a pip requirements file where every line is
``name==version --hash=sha256:...``:

- ``requirements.lock``: every runtime dependency of the ``ratchet`` package except torch,
  plus torch's own CPU dependencies and the build backend, so the package installs with
  ``--no-deps --no-build-isolation`` and nothing is fetched unpinned.
- ``torch-cpu.lock``: the CPU build of torch, for the control-plane image (no CUDA).
- ``torch-cuda.lock``: the CUDA build of torch from the default index and the NVIDIA
  libraries it pulls in, for the job image.

Versions are those of the environment running this script (the one the tests ran in)
wherever they satisfy pyproject.toml; pip's resolver picks the rest. Hashes are those of
the wheels pip selects for CPython 3.11 on linux x86_64, the images' platform, so the
script refuses to run anywhere else. Run it with the project's virtualenv::

    .venv/bin/python docker/lock.py

The CPU torch wheel comes from the PyTorch CPU index by default; pass
``--torch-cpu-pip-args`` to take it from elsewhere (a mirror, a wheel directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

logger = logging.getLogger("lock")

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parent / "pyproject.toml"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Distributions that only the CUDA build of torch needs.
GPU_ONLY_PREFIXES = ("nvidia-", "cuda-", "triton")


class LockError(Exception):
    """The lock cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class Pin:
    """One locked distribution: the wheel pip chose and its sha256."""

    name: str
    version: str
    sha256: str

    @property
    def key(self) -> str:
        return canonicalize_name(self.name)

    def line(self) -> str:
        return f"{self.name}=={self.version} \\\n    --hash=sha256:{self.sha256}"


# Extras the images install: the job image trains and the control-plane image serves
# ``hf`` checkpoints, so both need the hf family's libraries.
IMAGE_EXTRAS = ("hf",)


def runtime_requirements() -> tuple[list[Requirement], Requirement, list[Requirement]]:
    """The package's runtime requirements (with IMAGE_EXTRAS) without torch, torch itself,
    the build backend."""
    project = tomllib.loads(PYPROJECT.read_text())
    texts = list(project["project"]["dependencies"])
    for extra in IMAGE_EXTRAS:
        texts += project["project"]["optional-dependencies"][extra]
    requirements = [Requirement(text) for text in texts]
    torch = [req for req in requirements if canonicalize_name(req.name) == "torch"]
    if len(torch) != 1:
        raise LockError("pyproject.toml must list torch exactly once in its dependencies")
    others = [req for req in requirements if canonicalize_name(req.name) != "torch"]
    build = [Requirement(text) for text in project["build-system"]["requires"]]
    return others, torch[0], build


def torch_cpu_dependencies() -> list[Requirement]:
    """What the installed (tested) torch build needs, minus CUDA-only distributions."""
    needed = []
    for text in metadata.requires("torch") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name).startswith(GPU_ONLY_PREFIXES):
            continue
        needed.append(req)
    return needed


def tested_constraints(direct: list[Requirement]) -> list[str]:
    """name==version of this environment, skipping pins that pyproject.toml would refuse."""
    specifiers = {canonicalize_name(req.name): req.specifier for req in direct}
    constraints = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in {"torch", "ratchet"}:
            continue
        specifier = specifiers.get(name)
        if specifier is not None and not specifier.contains(dist.version, prereleases=True):
            logger.warning(
                "%s %s is installed but pyproject.toml asks for %s; locking a version it allows",
                name,
                dist.version,
                specifier,
            )
            continue
        constraints.append(f"{name}=={dist.version}")
    return sorted(set(constraints))


def resolve(requirements: list[str], constraints: list[str], pip_args: list[str]) -> list[Pin]:
    """Ask pip which wheels it would install (a dry run) and read their hashes."""
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "requirements.txt").write_text("\n".join(requirements) + "\n")
        (work / "constraints.txt").write_text("\n".join(constraints) + "\n")
        report = work / "report.json"
        command = [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--report",
            str(report),
            "-r",
            str(work / "requirements.txt"),
            "-c",
            str(work / "constraints.txt"),
            *pip_args,
        ]
        # No pip config files or PIP_* variables: the default index, never a machine's local
        # mirrors, wheel directories or version caps.
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            raise LockError(f"pip could not resolve the lock:\n{completed.stderr.strip()}")
        installs = json.loads(report.read_text())["install"]
    pins = []
    for item in installs:
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise LockError(f"pip reported no sha256 for {item['metadata']['name']}")
        pins.append(Pin(item["metadata"]["name"], item["metadata"]["version"], hashes["sha256"]))
    return sorted(pins, key=lambda pin: pin.key)


def write_lock(path: Path, purpose: str, pins: list[Pin]) -> None:
    header = [
        f"# {purpose}",
        "# Generated by docker/lock.py for CPython 3.11 on linux x86_64; do not edit by hand.",
        "# Install with: pip install --no-deps --require-hashes -r " + path.name,
    ]
    path.write_text("\n".join(header + [pin.line() for pin in pins]) + "\n")
    logger.info("wrote %s (%d pins)", path, len(pins))


def check_platform() -> None:
    """Hashes are per wheel, so the lock is only right for the images' own platform."""
    if sys.version_info[:2] != (3, 11) or sys.platform != "linux" or platform.machine() != "x86_64":
        raise LockError(
            "run docker/lock.py with CPython 3.11 on linux x86_64 (the images' platform); "
            f"this is {platform.python_version()} on {sys.platform} {platform.machine()}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--torch-cpu-pip-args",
        default=f"--index-url {TORCH_CPU_INDEX}",
        help="pip options that find the CPU torch wheel (default: the PyTorch CPU index)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check_platform()
        others, torch, build = runtime_requirements()
        torch_version = Version(metadata.version("torch")).public
        if not torch.specifier.contains(torch_version):
            raise LockError(f"installed torch {torch_version} does not satisfy {torch}")
        direct = others + torch_cpu_dependencies() + build
        constraints = tested_constraints(direct)
        common = resolve([str(req) for req in direct], constraints, [])
        with_cuda = resolve(
            [str(req) for req in direct] + [f"torch=={torch_version}"], constraints, []
        )
        common_keys = {pin.key: pin for pin in common}
        for pin in with_cuda:
            if pin.key in common_keys and common_keys[pin.key] != pin:
                raise LockError(f"{pin.name} resolves differently with CUDA torch: {pin}")
        cuda = [pin for pin in with_cuda if pin.key not in common_keys]
        cpu = resolve(
            [f"torch=={torch_version}+cpu"],
            [],
            ["--no-deps", *shlex.split(args.torch_cpu_pip_args)],
        )
    except LockError as exc:
        logger.error("lock: %s", exc)
        return 1
    write_lock(
        HERE / "requirements.lock", "Runtime dependencies of ratchet, without torch.", common
    )
    write_lock(HERE / "torch-cpu.lock", "torch, CPU build (control-plane image).", cpu)
    write_lock(
        HERE / "torch-cuda.lock", "torch, CUDA build, and its NVIDIA libraries (job image).", cuda
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
