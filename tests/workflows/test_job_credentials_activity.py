"""What the ``run_job`` activity hands a job, end to end (issue 43, items 2 and 8): the
credentials it needs (the rollout server's key, the judge's) reach the job, and nothing else
holds them: not the Kubernetes Job (only a Secret of the run's own, gone when the run
ends), not a file of the run. The rollout server's shared directory is the run's own, inside
what the job mounts writable.

Real Temporal dev server and Postgres; the Kubernetes executor against kmock's emulated API
server (the test plays the Job controller), the local executor with a real job process.
"""

from __future__ import annotations

import base64
import json
import sys
import textwrap
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from temporalio.client import Client

from services.artifacts import ArtifactStore
from services.db.models import Loop
from services.db.session import SessionFactory
from services.executors.kubernetes.launcher import KubernetesExecutor
from services.executors.local import LocalExecutor
from services.settings import Endpoint, ServingEndpoint, Settings
from tests.services.executors.kube_cluster import JOBS, SECRETS, EmulatedCluster
from tests.services.executors.test_kubernetes_launcher import COMPLETE, make_template
from tests.support import assert_eventually_async
from tests.workflows.test_jobs_activity import start_job, worker
from workflows.activities.jobs import JobActivities
from workflows.payloads.jobs import RunJobInput

JUDGE_KEY = "sk-judge-key-of-the-operator"
ROLLOUT_KEY = "vllm-key-that-loads-adapters"
NAMESPACE = "ml"


def settings_with_credentials(tmp_path: Path) -> Settings:
    return Settings(
        state_dir=tmp_path / "state",
        judge_endpoints={"grader": Endpoint(url="https://judge.example/v1", api_key=JUDGE_KEY)},
        serving_endpoints={
            "rollouts": ServingEndpoint(kind="openai", url="http://vllm:8000", api_key=ROLLOUT_KEY)
        },
        rollout_endpoint="rollouts",
        rollout_model="agent",
    )


def add_loop(sessions: SessionFactory, executor: str) -> str:
    name = f"bot-{uuid.uuid4().hex[:6]}"
    with sessions.begin() as session:
        session.add(
            Loop(
                name=name,
                environment="replay",
                executor=executor,
                curation_policy={"judge_endpoint": "grader"},
            )
        )
    return name


def job_input(loop: str) -> RunJobInput:
    run_id = f"{loop}-c1-train"
    return RunJobInput(
        run_id=run_id,
        loop=loop,
        kind="train",
        job_spec={"schema": "ratchet.job/v1", "kind": "train", "run_id": run_id},
        cycle=1,
        poll_interval_s=0.2,
    )


def files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


async def test_on_kubernetes_the_jobs_credentials_are_in_its_runs_secret_only(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    artifacts = ArtifactStore(tmp_path / "artifacts")
    loop = add_loop(session_factory, "kubernetes")
    input = job_input(loop)
    with EmulatedCluster() as cluster:
        executor = KubernetesExecutor(
            cluster.api_client,
            namespace=NAMESPACE,
            template=make_template(tmp_path),
            watch_read_slack_s=0.3,
        )
        activities = JobActivities(
            session_factory=session_factory,
            executors={"kubernetes": executor},
            artifacts=artifacts,
            settings=settings_with_credentials(tmp_path),
        )
        async with worker(temporal_client, task_queue, activities):
            handle = await start_job(temporal_client, task_queue, input)

            async def submitted() -> dict[str, Any]:
                jobs = [job for _, job in cluster.objects(JOBS)]
                assert len(jobs) == 1 and jobs[0]["spec"]["suspend"] is False
                return jobs[0]

            job = await assert_eventually_async(submitted)
            name = job["metadata"]["name"]
            secret = dict(cluster.objects(SECRETS))[name]
            pod = job["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            env = {var["name"]: var for var in container["env"]}

            # No key in the Job; each credential a secretKeyRef to the run's own Secret.
            assert JUDGE_KEY not in json.dumps(job) and ROLLOUT_KEY not in json.dumps(job)
            for variable in ("RATCHET_JUDGE_ENDPOINTS", "RATCHET_ROLLOUT_API_KEY"):
                assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": name, "key": variable}
            data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
            assert data["RATCHET_ROLLOUT_API_KEY"] == ROLLOUT_KEY
            assert json.loads(data["RATCHET_JUDGE_ENDPOINTS"])["grader"]["api_key"] == JUDGE_KEY
            assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
            # The rollout server's plain settings, and a shared dir the job can write.
            assert env["RATCHET_ROLLOUT_URL"]["value"] == "http://vllm:8000"
            assert env["RATCHET_ROLLOUT_MODEL"]["value"] == "agent"
            shared = PurePosixPath(env["RATCHET_ROLLOUT_SHARED_DIR"]["value"])
            writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
            assert any(shared.is_relative_to(m["mountPath"]) for m in writable), writable
            assert shared.is_relative_to(str(artifacts.root))  # where vLLM mounts the volume

            output = artifacts.run_dir(loop, input.run_id) / "output"
            (output / "metrics.json").write_text("{}")
            cluster.set_job_status(NAMESPACE, name, COMPLETE)
            result = await handle.result()

            assert result.status == "succeeded"
            assert dict(cluster.objects(SECRETS)) == {}  # gone with the run
    assert files_holding(tmp_path, JUDGE_KEY) == files_holding(tmp_path, ROLLOUT_KEY) == []


LOCAL_JOB = """
import json, os, pathlib
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
seen = {
    "judge": json.loads(os.environ["RATCHET_JUDGE_ENDPOINTS"])["grader"]["api_key"],
    "rollout": os.environ["RATCHET_ROLLOUT_API_KEY"],
    "shared": os.environ["RATCHET_ROLLOUT_SHARED_DIR"],
}
expected = {"judge": %r, "rollout": %r}
(out / "metrics.json").write_text(json.dumps({
    "keys_reached_the_job": all(seen[k] == v for k, v in expected.items()),
    "shared_dir": seen["shared"],
}))
"""


async def test_locally_the_credentials_reach_the_job_through_its_environment_only(
    temporal_client: Client, task_queue: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    artifacts = ArtifactStore(tmp_path / "artifacts")
    loop = add_loop(session_factory, "local")
    input = job_input(loop)
    script = textwrap.dedent(LOCAL_JOB % (JUDGE_KEY, ROLLOUT_KEY))
    executor = LocalExecutor(command=[sys.executable, "-c", script], poll_interval_s=0.05)
    activities = JobActivities(
        session_factory=session_factory,
        executors={"local": executor},
        artifacts=artifacts,
        settings=settings_with_credentials(tmp_path),
    )
    async with worker(temporal_client, task_queue, activities):
        result = await (await start_job(temporal_client, task_queue, input)).result()

    assert result.status == "succeeded", result.error
    assert result.metrics["keys_reached_the_job"] is True
    run_dir = artifacts.run_dir(loop, input.run_id)
    assert result.metrics["shared_dir"] == str(run_dir / "rollouts")
    # Neither the spec, the handle, the supervisor's files nor the log hold a key.
    assert files_holding(tmp_path, JUDGE_KEY) == files_holding(tmp_path, ROLLOUT_KEY) == []


@pytest.mark.parametrize("missing", ["endpoint", "model"])
def test_a_rollout_endpoint_must_be_a_serving_endpoint_with_a_model(
    missing: str, tmp_path: Path
) -> None:
    from services.settings import SettingsError, load_settings

    fields: dict[str, Any] = {
        "serving_endpoints": {"rollouts": {"kind": "openai", "url": "http://vllm:8000"}},
        "rollout_endpoint": "elsewhere" if missing == "endpoint" else "rollouts",
        "rollout_model": None if missing == "model" else "agent",
    }
    message = (
        "RATCHET_ROLLOUT_ENDPOINT names 'elsewhere'"
        if missing == "endpoint"
        else ("RATCHET_ROLLOUT_MODEL must name")
    )
    with pytest.raises(SettingsError, match=message):
        load_settings(state_dir=tmp_path, **fields)
