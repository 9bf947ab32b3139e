"""What a job of the loop is handed, by the job contract (docs/jobs.md): its document, the
files it reads, how many nodes it spans and the endpoints it may call.

The ``run_job`` activity (workflows/activities/jobs.py) builds an executor's ``JobRequest`` from
these; they are plain functions of the stage's job spec, the rows it names and the worker's
settings, so a job's inputs can be tested without Temporal or an executor.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import uri_to_path
from services.db.models import Dataset
from services.db.queries.runs import get_checkpoint
from services.environments.replay.endpoints import job_env as replay_job_env
from services.environments.replay.tool_config import ToolEndpointConfig
from services.executors.base import JobRequestError
from services.inference.rollout_env import API_KEY_ENV, MODEL_ENV, SHARED_DIR_ENV, URL_ENV
from services.settings import Endpoint, Settings, ToolEndpoint

REPLAY_FILE = "replay.jsonl"  # a train run's copy of its dataset's replay split
# Where a job writes the adapters it rolls out on the deployment's rollout server: inside the
# run dir, which the job mounts writable and the server reads at the same path.
ROLLOUT_SUBDIR = "rollouts"


class EndpointNotListed(JobRequestError):
    """A loop names a judge or tool endpoint the deployment no longer lists."""


def job_document(job_spec: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """The document the job reads (``spec.json``): the stage's job spec, naming its run
    (a spec that names one already keeps it)."""
    return {**job_spec, "run_id": job_spec.get("run_id", run_id)}


def job_files(
    *,
    session: Session,
    kind: str,
    job_spec: Mapping[str, Any],
    dataset_id: int | None,
    base_checkpoint_id: str | None,
) -> tuple[str | None, str | None]:
    """The dataset file and base checkpoint dir the job reads (paths, by the contract).

    The job spec's own ``dataset`` and ``base_checkpoint`` (or ``checkpoint`` for an eval)
    win; otherwise the dataset row (its train file for a train job, its eval file for the
    others) and the checkpoint row the stage names; a row that is gone gives no file.
    """
    dataset = job_spec.get("dataset") or None
    if dataset is None and dataset_id is not None:
        row = session.get(Dataset, dataset_id)
        if row is not None:
            dataset = str(uri_to_path(row.train_uri if kind == "train" else row.eval_uri))
    base = job_spec.get("base_checkpoint") or job_spec.get("checkpoint") or None
    if base is None and base_checkpoint_id is not None:
        checkpoint = get_checkpoint(session=session, checkpoint_id=base_checkpoint_id)
        if checkpoint is not None:
            base = str(uri_to_path(checkpoint.uri))
    return (str(dataset) if dataset else None, str(base) if base else None)


def replay_dataset(
    *, session: Session, kind: str, run_dir: Path, dataset_id: int | None
) -> dict[str, str]:
    """A train job's ``replay_dataset`` key: its dataset's replay split (successes on the
    trained side, which rft replays so the candidate does not forget them), or nothing when
    the dataset has none. Never the regression suite: the gate judges the candidate on that
    (services.curation.splits), and a dataset snapshotted before the replay split existed
    replays nothing.

    The file is copied into the run dir, the part of the artifact volume a Kubernetes job
    mounts (services.executors.kubernetes.builder), once per run, so the spec a retried
    activity builds names the same bytes."""
    if kind != "train":
        return {}
    path = run_dir / REPLAY_FILE
    if path.is_file():
        return {"replay_dataset": str(path)}
    row = session.get(Dataset, dataset_id) if dataset_id is not None else None
    if row is None or not row.replay_uri or row.replay_count < 1:
        return {}
    source = uri_to_path(row.replay_uri)
    if not source.is_file():
        return {}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(path)
    return {"replay_dataset": str(path)}


def job_nodes(job_spec: Mapping[str, Any]) -> int:
    """How many nodes the job spans (1 unless the spec says): an integer, or the job
    cannot be described."""
    raw = job_spec.get("nodes", 1)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise JobRequestError(f"the job spec's nodes must be an integer, got {raw!r}")
    return raw


def endpoint_env(curation_policy: Mapping[str, Any], settings: Settings) -> dict[str, str]:
    """The job-contract variables that hand a job the judge and live tool endpoints its
    loop names (services.environments.replay.endpoints), and only those: a job never holds
    a key its loop does not use. A name the settings do not list fails the run before it is
    submitted, naming what to configure."""
    judge, tool = curation_policy.get("judge_endpoint"), curation_policy.get("tool_endpoint")
    if not isinstance(judge, str) and not isinstance(tool, str):
        return {}
    try:
        return replay_job_env(
            judges=_listed(settings.judge_endpoints),
            tools=_listed_tools(settings.tool_endpoints),
            judge_names=[judge] if isinstance(judge, str) else [],
            tool_names=[tool] if isinstance(tool, str) else [],
        )
    except ValueError as exc:
        raise EndpointNotListed(
            f"{exc}: set RATCHET_JUDGE_ENDPOINTS / RATCHET_TOOL_ENDPOINTS on the worker, or "
            "change the loop's curation_policy"
        ) from None


def _listed(endpoints: Mapping[str, Endpoint]) -> dict[str, dict[str, Any]]:
    """The configured endpoints as the replay environment's job variables carry them."""
    return {
        name: {
            "url": endpoint.url,
            "api_key": endpoint.api_key.get_secret_value() if endpoint.api_key else None,
            "timeout_s": endpoint.timeout_s,
        }
        for name, endpoint in endpoints.items()
    }


@dataclass(frozen=True)
class JobEnvironment:
    """What a job is handed besides the job contract's files: ``plain`` settings and the
    ``credentials`` it needs, which an executor never writes where others can read them
    (``JobRequest.secret_env``)."""

    plain: dict[str, str] = field(default_factory=dict)
    credentials: dict[str, str] = field(default_factory=dict, repr=False)


def job_environment(
    curation_policy: Mapping[str, Any], settings: Settings, run_dir: Path
) -> JobEnvironment:
    """Everything a job of this loop gets in its environment: the deployment's rollout
    server (:func:`rollout_environment`) and the judge and tool endpoints the loop names
    (:func:`endpoint_env`). Every variable :func:`endpoint_env` returns is a credential, as
    a whole: its endpoints' keys travel inside it, whatever fields an endpoint has."""
    rollout = rollout_environment(settings, run_dir)
    return JobEnvironment(
        plain=rollout.plain,
        credentials={**rollout.credentials, **endpoint_env(curation_policy, settings)},
    )


def rollout_environment(settings: Settings, run_dir: Path) -> JobEnvironment:
    """The deployment's rollout server (``RATCHET_ROLLOUT_ENDPOINT``, one of the serving
    endpoints) as the job's remote backend reads it (services.inference.remote): its URL,
    the base model it serves and a shared directory of the run's own, in ``run_dir``,
    which the job mounts writable and the server reads at the same path (the chart's vLLM
    mounts the whole artifact volume). The endpoint's key is a credential: it loads and
    unloads adapters there. Nothing when no rollout endpoint is configured."""
    name = settings.rollout_endpoint
    if name is None:
        return JobEnvironment()
    endpoint = settings.serving_endpoints.get(name)
    if endpoint is None or settings.rollout_model is None:
        raise EndpointNotListed(
            f"the rollout endpoint {name!r} is not one of the serving endpoints, or has no "
            "model: set RATCHET_ROLLOUT_ENDPOINT and RATCHET_ROLLOUT_MODEL on the worker"
        )
    plain = {
        URL_ENV: endpoint.url,
        MODEL_ENV: settings.rollout_model,
        SHARED_DIR_ENV: str(run_dir / ROLLOUT_SUBDIR),
    }
    key = endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None
    return JobEnvironment(plain=plain, credentials={API_KEY_ENV: key} if key else {})


def _listed_tools(endpoints: Mapping[str, ToolEndpoint]) -> dict[str, dict[str, Any]]:
    """The configured tool endpoints as the job variable carries them, allow-lists
    included (the job enforces them)."""
    return {
        name: tool_endpoint_config(name, endpoint).to_json() for name, endpoint in endpoints.items()
    }


def tool_endpoint_config(name: str, endpoint: ToolEndpoint) -> ToolEndpointConfig:
    """A deployment's tool endpoint as the replay environment takes it."""
    return ToolEndpointConfig(
        name=name,
        kind=endpoint.kind,
        tools=frozenset(endpoint.tools),
        url=endpoint.url,
        command=tuple(endpoint.command) if endpoint.command else None,
        api_key=endpoint.api_key.get_secret_value() if endpoint.api_key else None,
        timeout_s=endpoint.timeout_s,
        requests_per_minute=endpoint.requests_per_minute,
        max_result_bytes=endpoint.max_result_bytes,
    )
