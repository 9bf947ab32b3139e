"""The job contract shared by the train and eval jobs: spec file, env vars, errors, exit codes.

A job gets ``--spec spec.json`` (or ``RATCHET_JOB_SPEC``) with
``{"schema": "ratchet.job/v1", "kind": ..., "run_id": ..., ...}``. The env vars
``RATCHET_DATASET``, ``RATCHET_BASE_CHECKPOINT`` and ``RATCHET_OUTPUT_DIR`` override the
spec's paths (an executor mounts inputs where it likes and says so through them). A job
writes its outputs under the output dir and exits 0, or exits non-zero with one line
``ratchet job: <reason>`` on stderr — no traceback for a bad spec or a missing input.

This module (with the job modules) is the only place the job reads its environment, through
:func:`job_environment`; everything else receives plain values. It is also the one place a
spec is written (:func:`train_job_document`, :func:`eval_job_document`), so the workflows,
the demo and the job that reads the spec agree on its keys; it imports the standard library
only (with the torch-free task file reader), for the worker and the api as much as for the
job image.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.environments.base import TaskFileError, TaskSpec, read_task_file
from services.training.config import HyperparameterError, Hyperparameters, parse_chain

JOB_SCHEMA = "ratchet.job/v1"
ENV_SPEC = "RATCHET_JOB_SPEC"
ENV_DATASET = "RATCHET_DATASET"
ENV_BASE_CHECKPOINT = "RATCHET_BASE_CHECKPOINT"
ENV_OUTPUT_DIR = "RATCHET_OUTPUT_DIR"
ENV_BASE_MODEL = "RATCHET_BASE_MODEL"  # an hf LoRA adapter's base, when not in the store
_JOB_ENV = (ENV_SPEC, ENV_DATASET, ENV_BASE_CHECKPOINT, ENV_OUTPUT_DIR, ENV_BASE_MODEL)
_TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

EXIT_BAD_SPEC = 2
EXIT_FAILED = 1


class JobError(Exception):
    """A reason the job cannot run or failed, reported as one stderr line."""

    def __init__(self, reason: str, exit_code: int = EXIT_BAD_SPEC):
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


def read_job_dataset(spec: JobSpec) -> list[TaskSpec]:
    """The spec's task file, read; a missing, unreadable or empty one is a :class:`JobError`.

    Train and eval jobs refuse a bad dataset with the same words, before any model loads.
    """
    if spec.dataset is None:
        raise JobError("no dataset: set 'dataset' in the spec or RATCHET_DATASET")
    if not spec.dataset.is_file():
        raise JobError(f"dataset {spec.dataset} does not exist")
    try:
        tasks = read_task_file(spec.dataset)
    except TaskFileError as exc:
        raise JobError(f"invalid dataset: {exc}") from None
    if not tasks:
        raise JobError(f"dataset {spec.dataset} has no tasks")
    return tasks


@dataclass(frozen=True)
class JobEnvironment:
    """The job contract's env vars and torchrun's rank variables, read once."""

    spec: str | None = None
    dataset: str | None = None
    base_checkpoint: str | None = None
    output_dir: str | None = None
    base_model: str | None = None
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this node


def job_environment(environ: Mapping[str, str] | None = None) -> JobEnvironment:
    """Read the job's env vars (``os.environ`` unless given)."""
    env = os.environ if environ is None else environ
    values = {name: env.get(name) or None for name in _JOB_ENV}
    ranks = {}
    for name in _TORCHRUN_ENV:
        raw = env.get(name)
        try:
            ranks[name] = int(raw) if raw else (1 if name.endswith("WORLD_SIZE") else 0)
        except ValueError:
            raise JobError(f"{name}={raw!r} is not an integer") from None
    return JobEnvironment(
        spec=values[ENV_SPEC],
        dataset=values[ENV_DATASET],
        base_checkpoint=values[ENV_BASE_CHECKPOINT],
        output_dir=values[ENV_OUTPUT_DIR],
        base_model=values[ENV_BASE_MODEL],
        world_size=ranks["WORLD_SIZE"],
        rank=ranks["RANK"],
        local_rank=ranks["LOCAL_RANK"],
        local_world_size=ranks["LOCAL_WORLD_SIZE"],
    )


@dataclass(frozen=True)
class JobSpec:
    """A validated job spec with paths resolved (env vars win over the spec)."""

    kind: str
    run_id: str
    raw: dict[str, Any]
    dataset: Path | None
    base_checkpoint: Path | None
    checkpoint: Path | None
    output_dir: Path
    seed: int
    device: str
    environment: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    base_model: Path | None = None  # an hf LoRA adapter's base dir, when not beside it


def train_job_document(
    *,
    run_id: str,
    environment: str,
    dataset: str,
    profile: Mapping[str, Any],
    base_checkpoint: str | None = None,
    cycle: int = 0,
) -> dict[str, Any]:
    """The spec of a train job: a loop's training profile (algorithm, hyperparameters, seed,
    device, nodes) applied to one run. The seed moves on with the cycle, so successive cycles
    do not sample the same rollouts; paths are paths, not URIs (the job reads files).

    ``profile`` is a whole training profile as JSON (``TrainingProfile.model_dump(mode=
    "json")``): its defaults are the profile's (services.loop.policies), stated there once,
    so a key missing here is a caller's bug and a ``KeyError``."""
    document: dict[str, Any] = {
        "schema": JOB_SCHEMA,
        "kind": "train",
        "run_id": run_id,
        "algorithm": profile["algorithm"],
        "environment": environment,
        "dataset": dataset,
    }
    if base_checkpoint is not None:
        document["base_checkpoint"] = base_checkpoint
    document["hyperparameters"] = dict(profile["hyperparameters"])
    document["seed"] = int(profile["seed"]) + cycle
    document["device"] = profile["device"]
    document["nodes"] = int(profile["nodes"])
    return document


def eval_job_document(
    *,
    run_id: str,
    environment: str,
    checkpoint: str,
    dataset: str,
    samples: int,
    seed: int,
    device: str = "auto",
    temperature: float = 0.0,
) -> dict[str, Any]:
    """The spec of an eval job: ``samples`` rollouts of ``checkpoint`` per task of
    ``dataset``, greedy unless a ``temperature`` above 0 is asked for (probes sample)."""
    document: dict[str, Any] = {
        "schema": JOB_SCHEMA,
        "kind": "eval",
        "run_id": run_id,
        "environment": environment,
        "checkpoint": checkpoint,
        "dataset": dataset,
        "samples": samples,
        "seed": seed,
        "device": device,
    }
    if temperature > 0:
        document["hyperparameters"] = {"temperature": temperature}
    return document


def parse_args(argv: list[str], prog: str) -> str | None:
    parser = argparse.ArgumentParser(prog=prog, add_help=True)
    parser.add_argument("--spec", help="path of the job spec JSON (default: $RATCHET_JOB_SPEC)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:
            raise
        raise JobError("usage: --spec spec.json") from None
    spec: str | None = args.spec
    return spec


def _read_spec(path: Path) -> dict[str, Any]:
    """The spec file's JSON object, or a job error saying why there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"spec file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"cannot read spec file {path}: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobError(
            f"spec file {path} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    if not isinstance(raw, dict):
        raise JobError(f"spec file {path} must hold a JSON object")
    return raw


def _check_spec(raw: dict[str, Any], *, kind: str) -> None:
    """Refuse a spec of another schema or kind, or with a field of the wrong type (named)."""
    if raw.get("schema") != JOB_SCHEMA:
        raise JobError(f"spec schema must be {JOB_SCHEMA!r}, got {raw.get('schema')!r}")
    if raw.get("kind") != kind:
        raise JobError(f"unknown job kind {raw.get('kind')!r} for this job (expected {kind!r})")
    run_id = raw.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise JobError("spec needs a non-empty string 'run_id'")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise JobError("spec 'seed' must be an integer")
    device = raw.get("device", "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise JobError(f"spec 'device' must be auto, cpu or cuda, got {device!r}")
    if not isinstance(raw.get("hyperparameters", {}), dict):
        raise JobError("spec 'hyperparameters' must be an object")
    if not isinstance(raw.get("environment", "toolcalc"), str):
        raise JobError("spec 'environment' must be a string")


def load_spec(spec_arg: str | None, env: JobEnvironment, *, kind: str) -> JobSpec:
    """Read and validate the spec for a job of ``kind`` ("train" or "eval")."""
    spec_path = spec_arg or env.spec
    if not spec_path:
        raise JobError(f"no job spec: pass --spec or set {ENV_SPEC}")
    raw = _read_spec(Path(spec_path))
    _check_spec(raw, kind=kind)
    run_id: str = raw["run_id"]
    seed: int = raw.get("seed", 0)
    device: str = raw.get("device", "auto")
    hyper: dict[str, Any] = raw.get("hyperparameters", {})
    environment: str = raw.get("environment", "toolcalc")
    output = env.output_dir or _opt_str(raw, "output_dir")
    if not output:
        raise JobError(f"no output dir: set 'output_dir' in the spec or {ENV_OUTPUT_DIR}")
    dataset = env.dataset or _opt_str(raw, "dataset")
    base = env.base_checkpoint or _opt_str(raw, "base_checkpoint")
    checkpoint = None
    if kind == "eval":
        checkpoint = (
            env.base_checkpoint or _opt_str(raw, "checkpoint") or _opt_str(raw, "base_checkpoint")
        )
    base_model = env.base_model or _opt_str(raw, "base_model")
    return JobSpec(
        base_model=Path(base_model) if base_model else None,
        kind=kind,
        run_id=run_id,
        raw=raw,
        dataset=Path(dataset) if dataset else None,
        base_checkpoint=Path(base) if base else None,
        checkpoint=Path(checkpoint) if checkpoint else None,
        output_dir=Path(output),
        seed=seed,
        device=device,
        environment=environment,
        hyperparameters=hyper,
    )


def job_hyperparameters(spec: JobSpec, *, family: str, algorithm: object) -> list[Hyperparameters]:
    """The spec's hyperparameters, one per stage of ``algorithm`` (a name or a chain),
    checked by the code the api checks a loop's profile with."""
    try:
        return parse_chain(family, algorithm, spec.hyperparameters, seed=spec.seed)
    except HyperparameterError as exc:
        raise JobError(f"invalid hyperparameters: {exc.message}") from None


def _opt_str(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise JobError(f"spec '{key}' must be a non-empty string path")
    return value


def fail(reason: str) -> None:
    """Print the single stderr line of a failed job."""
    first_line = reason.strip().splitlines()[0] if reason.strip() else "failed"
    sys.stderr.write(f"ratchet job: {first_line}\n")
    sys.stderr.flush()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n")
    tmp.replace(path)


def run_job_main(
    argv: list[str],
    *,
    kind: str,
    run: Callable[[JobSpec], int],
    finally_: Callable[[], None] | None = None,
) -> int:
    """The entry point every job shares: log to stdout, load the spec, run, keep the contract.

    A :class:`JobError` becomes its one stderr line and exit code; an unexpected exception
    keeps its traceback (a bug to report) and still ends with the contract line.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stdout,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        spec = load_spec(parse_args(argv, f"ratchet job {kind}"), job_environment(), kind=kind)
        return run(spec)
    except JobError as exc:
        fail(exc.reason)
        return exc.exit_code
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        fail(f"internal error: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        if finally_ is not None:
            finally_()


def environment_outputs(env: object, output_dir: Path) -> dict[str, Any]:
    """What the environment adds to ``metrics.json`` and the files beside it, when it has any
    (replay: its live tool answers and unanswerable calls, services.environments.replay.
    sandbox)."""
    outputs = getattr(env, "job_outputs", None)
    return dict(outputs(output_dir)) if callable(outputs) else {}
