"""The eval job: ``python -m services.evaluation.job --spec spec.json`` (or ``ratchet job eval``).

Spec (``ratchet.job/v1``, kind ``eval``)::

    {"schema": "ratchet.job/v1", "kind": "eval", "run_id": "e-1", "environment": "toolcalc",
     "checkpoint": "ckpt/", "dataset": "tasks.jsonl", "output_dir": "out/", "samples": 1,
     "seed": 0, "device": "auto", "hyperparameters": {"temperature": 0.0, ...}}

``RATCHET_BASE_CHECKPOINT`` (the checkpoint to evaluate), ``RATCHET_DATASET`` and
``RATCHET_OUTPUT_DIR`` override the spec's paths. Writes ``<output_dir>/results.jsonl``
(one line per task: task_id, passed, reward, components, turns, …) and
``<output_dir>/metrics.json`` (n, passed, pass_rate, ci_low, ci_high, tokens_per_s, …, and
``judge``: each LLM judge's calls, cache hits, tokens and cost, when replay tasks used one;
``judge_agreement``: where a rule decided and the loop names a judge, how often the judge
agreed with the rule on the sampled episodes, with a 95% Wilson interval);
and, for replay tasks, ``unanswerable_calls`` per task and ``tool_answers``, the listing of
``<output_dir>/tool_answers.jsonl``: services.environments.replay.sandbox),
and the probe set proof of delivery checks every deploy against: ``<output_dir>/probes.json``
(``services.evaluation.probe_capture``: the greedy answers, token ids and log-probs, to the first
``hyperparameters.probes`` tasks, 4 by default, 0 for none), listed in ``metrics.json`` as
``probes`` (file, sha256, count); with ``keep_episodes`` = N in the spec (a probe), also
``<output_dir>/episodes.jsonl``: up to N sampled successes and N failures of each task with
their token ids, listed as ``episode_file`` (services.training.episode_file); then exits 0;
a bad spec or input exits non-zero with one ``ratchet job: <reason>`` line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from services.environments.base import Environment, TaskSpec
from services.environments.registry import get_environment
from services.evaluation.evaluator import EvaluationResult, EvaluationSettings, evaluate
from services.evaluation.probe_capture import DEFAULT_PROBES, capture_probes, probe_engine
from services.evaluation.probes import write_probes
from services.evaluation.results import RESULTS_FILE
from services.evaluation.stats import wilson_interval
from services.inference.remote import RemoteError, attach_rollout_backend
from services.training.checkpoint import CheckpointError, read_manifest
from services.training.device import DeviceError, resolve_device, use_threads
from services.training.episode_file import EpisodeFileError, keep_episodes_option, write_episodes
from services.training.family import FamilyModel, family_for
from services.training.jobspec import (
    EXIT_FAILED,
    JobError,
    JobSpec,
    environment_outputs,
    read_job_dataset,
    run_job_main,
    write_json,
)
from services.training.keep import EpisodeKeeper
from services.training.phases import PhaseClock, phase_report

logger = logging.getLogger("services.evaluation.job")

_HYPER = {
    "temperature": float,
    "max_turns": int,
    "max_new_tokens": int,
    "confidence": float,
    "batch_size": int,
    "threads": int,
    "probes": int,
}


def eval_job_main(argv: list[str]) -> int:
    """Run an eval job; returns the process exit code."""
    return run_job_main(argv, kind="eval", run=_run)


def _options(spec: JobSpec) -> dict[str, Any]:
    hyper = dict(spec.hyperparameters)
    unknown = sorted(set(hyper) - set(_HYPER))
    if unknown:
        raise JobError(f"unknown eval hyperparameter(s): {', '.join(unknown)}")
    options: dict[str, Any] = {}
    for key, value in hyper.items():
        kind = _HYPER[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and not isinstance(value, int))
        ):
            raise JobError(f"hyperparameters.{key} must be a {kind.__name__}")
        if key == "threads" and value < 1:
            raise JobError("hyperparameters.threads must be a positive integer")
        options[key] = kind(value)
    samples = spec.raw.get("samples", 1)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise JobError("spec 'samples' must be a positive integer")
    options["samples"] = samples
    return options


def _run(spec: JobSpec) -> int:
    options = _options(spec)
    env = _environment(spec)
    tasks = read_job_dataset(spec)
    use_threads(options.pop("threads", None))
    clock = PhaseClock()
    probes = options.pop("probes", DEFAULT_PROBES)
    if probes < 0:
        raise JobError("hyperparameters.probes must be >= 0")
    policy = _policy(spec, options, clock)
    keeper = _keeper(spec, policy)
    compare = getattr(env, "compare_with_judges", None)
    if callable(compare):  # replay: a judge beside a rule is asked on a sample
        compare()
    started = time.monotonic()
    try:
        with clock.phase("evaluation"):
            settings = EvaluationSettings(seed=spec.seed, **options)
            result = evaluate(policy, env, tasks, settings, keeper=keeper)
    except ValueError as exc:  # e.g. an environment with no chat rendering for an hf model
        raise JobError(str(exc)) from None
    except RemoteError as exc:
        raise JobError(f"remote episodes failed: {exc}", exit_code=EXIT_FAILED) from None
    _write_results(spec, result)
    metrics = {
        **result.metrics(),
        "schema": "ratchet.metrics/v1",
        "kind": "eval",
        "run_id": spec.run_id,
        "checkpoint_id": policy.checkpoint_id,
        "environment": env.name,
        "samples": options["samples"],
        "device": str(policy.device),
        "job_wall_s": round(time.monotonic() - started, 3),
        "phases": phase_report(clock),
    }
    judge_usage = getattr(env, "judge_usage", None)
    if callable(judge_usage) and (usage := judge_usage()):
        # Calls, cache hits, tokens and cost of each LLM judge the tasks named.
        metrics["judge"] = usage
    agreement = getattr(env, "judge_agreement", None)
    if callable(agreement) and (counts := agreement()):
        metrics["judge_agreement"] = {name: _with_interval(c) for name, c in counts.items()}
    # Replay: the live tool answers got (tool_answers.jsonl) and unanswerable calls per task.
    metrics.update(environment_outputs(env, spec.output_dir))
    if probes:
        metrics.update(_probes(policy, env, tasks, probes, spec))
    if keeper is not None:
        metrics["episode_file"] = write_episodes(spec.output_dir, keeper.records())
    write_json(spec.output_dir / "metrics.json", metrics)
    logger.info(
        "eval %s: %d/%d passed (%.3f)", spec.run_id, result.passed, result.n, result.pass_rate
    )
    return 0


def _with_interval(counts: Mapping[str, int]) -> dict[str, Any]:
    """A judge's agreement counts with the share agreeing and its 95% Wilson interval."""
    episodes, agreed = int(counts.get("episodes", 0)), int(counts.get("agreed", 0))
    low, high = wilson_interval(agreed, episodes)
    share = agreed / episodes if episodes else None
    return {**counts, "share": share, "ci_low": round(low, 6), "ci_high": round(high, 6)}


def _environment(spec: JobSpec) -> Environment:
    """The spec's environment, once its checkpoint is known to be there."""
    try:
        env = get_environment(spec.environment)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if spec.checkpoint is None:
        raise JobError("no checkpoint: set 'checkpoint' in the spec or RATCHET_BASE_CHECKPOINT")
    if not spec.checkpoint.is_dir():
        raise JobError(f"checkpoint {spec.checkpoint} does not exist")
    return env


def _policy(spec: JobSpec, options: dict[str, Any], clock: PhaseClock) -> FamilyModel:
    """The checkpoint loaded (its time the job's ``sync``), its rollout backend attached and
    its family's evaluation defaults filled into ``options``."""
    try:
        with clock.phase("sync"):  # loading the checkpoint is the job's weight movement
            policy, defaults = _load_policy(spec)
    except CheckpointError as exc:
        raise JobError(f"checkpoint rejected: {exc}") from None
    except DeviceError as exc:
        raise JobError(str(exc)) from None
    try:  # episodes on an OpenAI-compatible server (vLLM) that loads the checkpoint
        attach_rollout_backend(
            policy, spec.raw.get("rollout_backend"), os.environ, checkpoint=spec.checkpoint
        )
    except ValueError as exc:
        raise JobError(str(exc)) from None
    for key, value in defaults.items():  # e.g. hf: chat turns are longer, CPU batches smaller
        options.setdefault(key, value)
    clock.device = policy.device
    return policy


def _write_results(spec: JobSpec, result: EvaluationResult) -> None:
    """Every task's result as a line of ``results.jsonl``, written whole or not at all."""
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    results_path = spec.output_dir / RESULTS_FILE
    tmp = results_path.with_name(f".{RESULTS_FILE}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in result.results:
            fh.write(json.dumps(row.to_dict(), sort_keys=True) + "\n")
    tmp.replace(results_path)


def _probes(
    policy: FamilyModel, env: Environment, tasks: list[TaskSpec], count: int, spec: JobSpec
) -> dict[str, Any]:
    """Capture and write the probe set; the ``metrics.json`` keys that list it (or say why
    there is none: no task fits the model's context)."""
    try:
        captured = capture_probes(probe_engine(policy), env, tasks, count=count)
    except ValueError as exc:  # a prompt the template cannot render
        raise JobError(f"cannot capture the probe set: {exc}") from None
    if not captured:
        return {"probes_skipped": "no task's first turn fits the model's context"}
    checkpoint_id = policy.checkpoint_id or ""
    return {"probes": write_probes(spec.output_dir, checkpoint_id, captured)}


def _keeper(spec: JobSpec, policy: FamilyModel) -> EpisodeKeeper | None:
    """What a probe keeps of its episodes (spec ``keep_episodes`` per task and kind): its
    failures too, since a task nobody solved yet is shown by them."""
    try:
        per_task = keep_episodes_option(spec.raw)
    except EpisodeFileError as exc:
        raise JobError(str(exc)) from None
    return EpisodeKeeper(policy, per_task=per_task, failures_alone=True) if per_task else None


def _load_policy(spec: JobSpec) -> tuple[FamilyModel, Mapping[str, int]]:
    """The checkpoint as a model of its family, verified on load, for inference; and the
    family's evaluation defaults."""
    assert spec.checkpoint is not None
    family = family_for(read_manifest(spec.checkpoint).family)
    device = resolve_device(spec.device)
    model = family.load(spec.checkpoint, device=device, base_dir=spec.base_model)
    return model, family.eval_defaults


def main() -> None:
    raise SystemExit(eval_job_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
