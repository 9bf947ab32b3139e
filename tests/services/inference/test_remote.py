"""The remote backend gives the episodes the local engine gives, against a real ``ratchet
serve`` process: the same prompt ids, the same sampled ids, the same log-probs; the weights
being trained reach the server as a LoRA adapter for the call and leave it after; every
failure of the server is a :class:`RemoteError` naming the URL."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.inference.engine import GenerationRequest, SamplingParams
from services.inference.hf import HFEngine
from services.inference.remote import (
    RemoteBackend,
    RemoteClient,
    RemoteEngine,
    RemoteError,
    RemotePolicy,
    attach_rollout_backend,
    rollout_config,
)
from services.inference.rollout import ChatRollout, RolloutSettings, run_chat_episodes
from services.serving.base import CheckpointRef
from services.training.config import HFGRPOConfig
from services.training.family import Rollouts
from services.training.hf.family import HFFamily
from services.training.hf.model import HFModel
from services.training.jobspec import EXIT_FAILED
from tests.services.modelserver.conftest import ServeProcess, free_port, path_of

ENV = ToolcalcEnvironment()
OPTIONS: dict[str, Any] = {"max_turns": 3, "max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def replying_server(
    tool_calling_llama: CheckpointRef, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """``ratchet serve`` (the real command, in its own process) serving the replying llama."""
    log = tmp_path_factory.mktemp("remote") / "serve.log"
    server = ServeProcess(path_of(tool_calling_llama), name="base", log=log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def adapter_server(
    llama_with_adapters: list[CheckpointRef], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """``ratchet serve`` serving a random llama; adapters load from the directory above it."""
    log = tmp_path_factory.mktemp("remote") / "serve.log"
    server = ServeProcess(path_of(llama_with_adapters[0]), name="base", log=log)
    yield server
    server.stop()


def turns(rollouts: list[ChatRollout]) -> list[list[tuple[list[int], list[int]]]]:
    return [[(t.prompt_ids, t.completion_ids) for t in r.turns] for r in rollouts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_remote_episodes_equal_the_local_engines(
    tool_calling_llama: CheckpointRef, replying_server: ServeProcess, temperature: float
) -> None:
    policy = HFModel.load(path_of(tool_calling_llama), device="cpu")
    engine = HFEngine(policy.model, policy.tokenizer, path="memory", version="v0")
    tasks = [t for t in ENV.generate_tasks(3, seed=2, api_version="v2") for _ in range(2)]
    seeds = [7 * i + 1 for i in range(len(tasks))]
    settings = RolloutSettings(**{**OPTIONS, "temperature": temperature})
    local, _ = run_chat_episodes(engine, ENV, tasks, seeds=seeds, settings=settings)

    backend = RemoteBackend(url=replying_server.url, model="base", max_concurrency=4)
    with RemotePolicy(backend).engine(engine) as remote_engine:
        remote, stats = run_chat_episodes(remote_engine, ENV, tasks, seeds=seeds, settings=settings)

    assert turns(remote) == turns(local)  # sampled too: the server samples as the engine does
    if temperature == 0:
        assert max(len(r.turns) for r in remote) == 3  # multi-turn: a tool call every turn
    for near, far in zip(local, remote, strict=True):
        assert far.episode.completions == near.episode.completions
        assert far.episode.end_reason == near.episode.end_reason
        for a, b in zip(near.turns, far.turns, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
            assert b.truncated == a.truncated
    assert stats.generated_tokens == sum(len(t.completion_ids) for r in remote for t in r.turns)
    assert stats.prefill_tokens_cached > 0  # the server's prefix cache, reported as usage


def test_the_weights_being_trained_are_loaded_for_the_rollouts_and_unloaded_after(
    llama_with_adapters: list[CheckpointRef], adapter_server: ServeProcess
) -> None:
    base_dir = path_of(llama_with_adapters[0])
    model = HFFamily().load(base_dir, device=torch.device("cpu"), training=HFGRPOConfig())
    with torch.no_grad():  # a trained adapter: it changes the answers (a fresh one would not)
        torch.manual_seed(5)
        for _, param in model.trainable_parameters():
            param.normal_(0.0, 0.5)
    tasks = ENV.generate_tasks(4, seed=3, api_version="v1")
    asked: dict[str, Any] = {"seeds": [1, 2, 3, 4], **OPTIONS}
    local = model.rollouts(ENV, tasks, **asked)
    seen: list[str] = []

    backend = RemoteBackend(url=adapter_server.url, model="base", shared_dir=base_dir.parent)
    attach_rollout_backend(
        model, {"url": backend.url, "model": "base", "shared_dir": str(base_dir.parent)}, {}
    )
    remote_policy = model.chat.remote
    assert remote_policy is not None
    publish = remote_policy.publish
    assert publish is not None

    def watched(out_dir: Path) -> None:
        publish(out_dir)
        seen.append(out_dir.name)

    remote_policy.publish = watched
    remote = model.rollouts(ENV, tasks, **asked)

    assert episode_turns(remote) == episode_turns(local)
    assert [e.reward for e in remote.episodes] == [e.reward for e in local.episodes]
    base_only = HFModel.load(base_dir, device="cpu").rollouts(ENV, tasks, **asked)
    assert episode_turns(base_only) != episode_turns(local)  # the adapter was what answered
    served = [m["id"] for m in httpx.get(f"{adapter_server.url}/v1/models").json()["data"]]
    assert len(seen) == 1 and seen[0] not in served and served == ["base"]
    assert not (base_dir.parent / seen[0]).exists()  # its directory is removed too


def episode_turns(rollouts: Rollouts) -> list[list[tuple[list[int], list[int]]]]:
    return [episode.turns for episode in rollouts.episodes]


def test_an_eval_job_loads_the_checkpoint_it_evaluates(
    llama_with_adapters: list[CheckpointRef], adapter_server: ServeProcess
) -> None:
    adapter = path_of(llama_with_adapters[1])
    base_dir = path_of(llama_with_adapters[0])
    model = HFFamily().load(adapter, device=torch.device("cpu"), base_dir=base_dir)
    tasks = ENV.generate_tasks(3, seed=4, api_version="v1")
    asked: dict[str, Any] = {"seeds": [1, 2, 3], **OPTIONS}
    local = model.rollouts(ENV, tasks, **asked)

    attach_rollout_backend(
        model, {"url": adapter_server.url, "model": "base"}, {}, checkpoint=adapter
    )
    remote = model.rollouts(ENV, tasks, **asked)

    assert episode_turns(remote) == episode_turns(local)
    served = [m["id"] for m in httpx.get(f"{adapter_server.url}/v1/models").json()["data"]]
    assert served == ["base"]


def remote_run(backend: RemoteBackend, engine: HFEngine, **policy: Any) -> None:
    tasks = ENV.generate_tasks(1, seed=2, api_version="v2")
    with RemotePolicy(backend, **policy).engine(engine) as remote_engine:
        run_chat_episodes(remote_engine, ENV, tasks, seeds=[0], settings=RolloutSettings(**OPTIONS))


@pytest.fixture(scope="module")
def local_engine(tool_calling_llama: CheckpointRef) -> HFEngine:
    policy = HFModel.load(path_of(tool_calling_llama), device="cpu")
    return HFEngine(policy.model, policy.tokenizer, path="memory", version="v0")


def test_a_server_that_is_not_there_is_named(local_engine: HFEngine) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteError, match=f"cannot reach {url}/v1/completions"):
        remote_run(RemoteBackend(url=url, model="base"), local_engine)


def test_an_eval_job_pointed_at_a_dead_server_fails_in_one_line(
    tool_calling_llama: CheckpointRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_task_file(tmp_path / "tasks.jsonl", ENV.generate_tasks(2, seed=2, api_version="v2"))
    url = f"http://127.0.0.1:{free_port()}"
    spec = {
        "schema": "ratchet.job/v1",
        "kind": "eval",
        "run_id": "e-remote",
        "device": "cpu",
        "checkpoint": str(path_of(tool_calling_llama)),
        "dataset": str(tmp_path / "tasks.jsonl"),
        "output_dir": str(tmp_path / "out"),
        "rollout_backend": {"url": url, "model": "base"},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))

    assert eval_job_main(["--spec", str(tmp_path / "spec.json")]) == EXIT_FAILED

    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress
    assert last == (
        f"ratchet job: remote episodes failed: cannot reach {url}/v1/load_lora_adapter: "
        "[Errno 111] Connection refused"
    )


def test_a_server_that_never_answers_times_out(local_engine: HFEngine) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend = RemoteBackend(url=url, model="base", timeout_s=0.5)
        with pytest.raises(RemoteError, match=rf"{url}/v1/completions did not answer within 0.5s"):
            remote_run(backend, local_engine)


def test_the_servers_4xx_comes_back_with_its_message(
    local_engine: HFEngine, replying_server: ServeProcess
) -> None:
    missing = RemoteBackend(url=replying_server.url, model="nope")
    with pytest.raises(RemoteError, match=r"/v1/completions answered 404: the model 'nope'"):
        remote_run(missing, local_engine)
    backend = RemoteBackend(url=replying_server.url, model="base")
    with pytest.raises(RemoteError, match=r"/v1/load_lora_adapter answered 400: '/etc'"):
        remote_run(backend, local_engine, checkpoint=Path("/etc"))


def test_a_wrong_api_key_is_a_401_named(
    local_engine: HFEngine, tool_calling_llama: CheckpointRef, tmp_path: Path
) -> None:
    server = ServeProcess(
        path_of(tool_calling_llama), name="base", log=tmp_path / "serve.log", token="right"
    )
    try:
        backend = RemoteBackend(url=server.url, model="base", api_key="wrong")
        with pytest.raises(RemoteError, match=r"answered 401"):
            remote_run(backend, local_engine)
        remote_run(RemoteBackend(url=server.url, model="base", api_key="right"), local_engine)
    finally:
        server.stop()


BAD_CONFIGS = [
    ("not an object", "rollout_backend must be an object"),
    ({"model": "m"}, "rollout_backend.url must be an http(s) URL"),
    ({"url": "vllm:8000", "model": "m"}, "rollout_backend.url must be an http(s) URL"),
    ({"url": "http://vllm:8000"}, "rollout_backend.model must name"),
    ({"url": "http://v", "model": "m", "timeout_s": 0}, "rollout_backend.timeout_s must be"),
    ({"url": "http://v", "model": "m", "timeout_s": True}, "rollout_backend.timeout_s must be"),
    ({"url": "http://v", "model": "m", "max_concurrency": 0}, "rollout_backend.max_concurrency"),
    ({"url": "http://v", "model": "m", "shared_dir": 3}, "rollout_backend.shared_dir must be"),
    ({"url": "http://v", "model": "m", "api_key": "s"}, "rollout_backend.api_key is not a"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_CONFIGS)
def test_a_bad_rollout_backend_config_names_the_key(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RemoteBackend.from_config(raw, {})


def test_the_config_reads_the_key_from_the_named_env_var() -> None:
    raw = {"url": "http://vllm:8000/", "model": "m", "api_key_env": "MY_KEY"}
    backend = RemoteBackend.from_config(raw, {"MY_KEY": "sekret"})
    assert (backend.url, backend.api_key) == ("http://vllm:8000", "sekret")
    assert "sekret" not in repr(backend)


def test_training_weights_need_a_shared_dir() -> None:
    with pytest.raises(ValueError, match="shared_dir is required"):
        RemotePolicy(RemoteBackend(url="http://v", model="m"), publish=lambda _: None)


def test_a_family_without_a_remote_path_is_refused() -> None:
    class Tiny:
        family = "tiny"

    with pytest.raises(ValueError, match="the tiny family rolls out in the job only"):
        attach_rollout_backend(Tiny(), {"url": "http://v", "model": "m"}, {})
    deployment = {"RATCHET_ROLLOUT_URL": "http://v", "RATCHET_ROLLOUT_MODEL": "m"}
    assert attach_rollout_backend(Tiny(), None, deployment) is None  # stays in the job


def test_a_deployment_points_every_job_through_the_environment() -> None:
    environ = {
        "RATCHET_ROLLOUT_URL": "http://vllm:8000",
        "RATCHET_ROLLOUT_MODEL": "agent",
        "RATCHET_ROLLOUT_SHARED_DIR": "/var/lib/ratchet/artifacts/rollouts",
        "RATCHET_ROLLOUT_API_KEY": "k",
    }
    assert rollout_config(None, environ) == {
        "url": "http://vllm:8000",
        "model": "agent",
        "shared_dir": "/var/lib/ratchet/artifacts/rollouts",
    }
    spec_value = {"url": "http://other:8000", "model": "m"}
    assert rollout_config(spec_value, environ) is spec_value  # the spec's own wins
    assert rollout_config(None, {}) is None
    with pytest.raises(ValueError, match="RATCHET_ROLLOUT_MODEL must name"):
        rollout_config(None, {"RATCHET_ROLLOUT_URL": "http://vllm:8000"})


def vllm_answer(**choice: object) -> dict[str, Any]:
    """/v1/completions as vLLM answers it: prompt_token_ids on the choice."""
    return {
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "finish_reason": "stop",
                "token_ids": [5, 6, 2],
                "prompt_token_ids": [1, 2, 3],
                "logprobs": {"token_logprobs": [-0.5, -0.25, -0.125]},
                **choice,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3},
    }


def test_vllms_answer_is_read_as_it_is_and_checked(local_engine: HFEngine) -> None:
    engine = RemoteEngine(
        local_engine, RemoteClient(RemoteBackend(url="http://vllm:8000", model="m")), "m"
    )
    request = GenerationRequest([1, 2, 3], SamplingParams(8))
    stop = sorted(local_engine.eos_ids)[0]
    try:
        result = engine.result_of(request, vllm_answer(token_ids=[5, 6, stop]))
        assert (result.sampled_ids, result.token_ids) == ([5, 6, stop], [5, 6])
        assert result.logprobs == [-0.5, -0.25, -0.125] and result.finish_reason == "stop"
        assert result.cached_tokens == 0
        with pytest.raises(RemoteError, match="another prompt"):
            engine.result_of(request, vllm_answer(prompt_token_ids=[0, 1, 2, 3]))
        with pytest.raises(RemoteError, match="'return_token_ids' and 'logprobs'"):
            engine.result_of(request, vllm_answer(token_ids=None))
        with pytest.raises(RemoteError, match="3 token ids but 2 log-probs"):
            engine.result_of(request, vllm_answer(logprobs={"token_logprobs": [-1.0, -1.0]}))
    finally:
        engine.close()


def test_a_train_job_rolls_out_where_the_worker_points_it_with_the_key_it_is_handed(
    llama_with_adapters: list[CheckpointRef],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43 (items 2 and 8): the worker's rollout endpoint becomes the job's environment
    (services.loop.job_documents), and with exactly that environment a train job publishes
    each step's adapter into its run's own shared directory (made on first use, inside the
    run dir a Kubernetes job mounts) and loads it with the key it was handed as a credential:
    on a keyed ``ratchet serve`` the server's admin key, which the API key cannot stand in
    for."""
    from pydantic import SecretStr

    from services.loop.job_documents import job_environment
    from services.settings import ServingEndpoint, Settings

    monkeypatch.setenv("RATCHET_SERVE_MODEL_ROOTS", json.dumps([str(tmp_path)]))
    base_dir = path_of(llama_with_adapters[0])
    server = ServeProcess(
        base_dir, name="base", log=tmp_path / "serve.log", token="agents", admin_token="worker"
    )
    try:
        endpoint = ServingEndpoint(kind="openai", url=server.url, api_key=SecretStr("worker"))
        settings = Settings(
            serving_endpoints={"rollouts": endpoint},
            rollout_endpoint="rollouts",
            rollout_model="base",
        )
        run_dir = tmp_path / "loops" / "demo" / "runs" / "r-1"
        handed = job_environment({}, settings, run_dir)
        environ = {**handed.plain, **handed.credentials}
        model = HFFamily().load(base_dir, device=torch.device("cpu"), training=HFGRPOConfig())
        tasks = ENV.generate_tasks(2, seed=3, api_version="v1")
        asked: dict[str, Any] = {"seeds": [1, 2], **OPTIONS}

        attach_rollout_backend(model, None, {**environ, "RATCHET_ROLLOUT_API_KEY": "agents"})
        with pytest.raises(RemoteError, match="load_lora_adapter answered 403"):
            model.rollouts(ENV, tasks, **asked)  # the key that serves never loads

        attach_rollout_backend(model, None, environ)
        remote_policy = model.chat.remote
        assert remote_policy is not None and remote_policy.publish is not None
        publish, published = remote_policy.publish, []

        def watched(out_dir: Path) -> None:
            publish(out_dir)
            published.append(out_dir)

        remote_policy.publish = watched
        rollouts = model.rollouts(ENV, tasks, **asked)

        assert len(rollouts.episodes) == 2
        (adapter,) = published
        assert adapter.parent == run_dir / "rollouts"
        assert not adapter.exists()  # removed after the step's rollouts
        agents = {"Authorization": "Bearer agents"}
        cards = httpx.get(f"{server.url}/v1/models", headers=agents).json()["data"]
        assert [card["id"] for card in cards] == ["base"]  # unloaded after the step
    finally:
        server.stop()
