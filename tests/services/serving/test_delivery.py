"""Proof of delivery against real ``ratchet serve`` processes: the candidate's probe set (from
its eval job) passes where the server serves the candidate and fails the deploy where it
answers with other weights under the candidate's name, for the local and the
OpenAI-compatible targets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import SecretStr

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.evaluation.probes import Probe, ProbeSet, read_listed_probes
from services.serving.base import CheckpointRef, DeployFailed
from services.serving.client import ModelServerClient
from services.serving.delivery import LOGPROB_ATOL, NO_PROBE_SET, mismatch, prove_delivery
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.services.modelserver.conftest import ServeProcess, path_of

KEY = "key-of-the-model-server"  # its admin key: the worker's, which loads models
AGENT_KEY = "key-the-agents-hold"  # its API key: serves only
MODEL = "agent"
# A context long enough for toolcalc's chat rendering and the probes' tokens.
TINY = GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=256)


def checkpoint(path: Path, seed: int) -> CheckpointRef:
    """A tiny GPT with decisive greedy choices: a random init is near-uniform (its argmax
    would ride on rounding), so its weights are scaled until the top token stands out."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(8.0)
    manifest = save_checkpoint(model, TINY, path)
    return CheckpointRef(id=manifest.checkpoint_id, uri=path.resolve().as_uri())


def probes_of(root: Path, ref: CheckpointRef) -> ProbeSet:
    """The probe set ``ref``'s eval job records (the job as a cycle runs it)."""
    out = root / f"eval-{ref.id[:8]}"
    spec = root / f"spec-{ref.id[:8]}.json"
    spec.write_text(
        json.dumps(
            {
                "schema": "ratchet.job/v1",
                "kind": "eval",
                "run_id": "e-candidate",
                "environment": "toolcalc",
                "checkpoint": str(path_of(ref)),
                "dataset": str(root / "tasks.jsonl"),
                "output_dir": str(out),
                "device": "cpu",
                "hyperparameters": {"max_turns": 1, "max_new_tokens": 4},
            }
        )
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    probe_set = read_listed_probes(out, json.loads((out / "metrics.json").read_text()))
    assert probe_set is not None
    return probe_set


class World:
    """The candidate, another checkpoint, the candidate's probe set, and servers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        write_task_file(
            root / "tasks.jsonl",
            ToolcalcEnvironment().generate_tasks(4, seed=5, api_version="v1"),
        )
        self.candidate = checkpoint(root / "candidate", 11)
        self.other = checkpoint(root / "other", 12)
        self.probes = probes_of(root, self.candidate)
        self.servers: list[ServeProcess] = []
        self.serving_candidate = self.serve(self.candidate)
        self.serving_other = self.serve(self.other)

    def serve(self, ref: CheckpointRef) -> ServeProcess:
        """``ratchet serve`` answering ``ref``'s weights under the candidate's alias."""
        server = ServeProcess(
            path_of(ref),
            name=MODEL,
            log=self.root / f"serve-{len(self.servers)}.log",
            token=AGENT_KEY,
            admin_token=KEY,
        )
        self.servers.append(server)
        return server


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("delivery")
    patch = pytest.MonkeyPatch()
    # The servers may load adapters from the store (the deploy test loads the candidate).
    patch.setenv("RATCHET_SERVE_MODEL_ROOTS", json.dumps([str(root)]))
    world = World(root)
    yield world
    for server in world.servers:
        server.stop()
    patch.undo()


def targets_for(server: ServeProcess, tmp_path: Path) -> ServingTargets:
    settings = Settings(
        state_dir=tmp_path / "state",
        serve_api_key=SecretStr(AGENT_KEY),
        serve_admin_key=SecretStr(KEY),
        serve_port=server.port,
        serving_endpoints={
            "srv": ServingEndpoint.model_validate(
                {"kind": "openai", "url": server.url, "api_key": KEY}
            )
        },
    )
    return ServingTargets(settings, start_local_server=False)


CONFIGS = {
    "local": {"kind": "local", "model": MODEL},
    "openai": {"kind": "openai", "endpoint": "srv", "model": MODEL},
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_proof_passes_where_the_server_serves_the_candidate(
    world: World, tmp_path: Path, kind: str
) -> None:
    targets = targets_for(world.serving_candidate, tmp_path)
    proof = targets.prove(CONFIGS[kind], world.candidate.id, world.probes)
    assert proof.verified and proof.probes == 4
    assert proof.note == "verified: 4 probes match on token ids and log-probs"


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_proof_fails_where_other_weights_answer_under_the_candidates_name(
    world: World, tmp_path: Path, kind: str
) -> None:
    targets = targets_for(world.serving_other, tmp_path)
    with pytest.raises(DeployFailed) as failed:
        targets.prove(CONFIGS[kind], world.candidate.id, world.probes)
    message = str(failed.value)
    assert message.startswith(
        f"delivery not proven: 'agent' does not answer as {world.candidate.id[:12]} did when "
        f"evaluated: probe 0 (task {world.probes.probes[0].task_id[:12]}): token "
    )
    assert "expected id" in message or "expected log-prob" in message


def test_a_deploy_that_reaches_the_server_is_proven_and_one_that_is_undone_is_not(
    world: World, tmp_path: Path
) -> None:
    """The OpenAI target deploys the candidate onto a server serving other weights: proven.
    Then the alias is pointed back at the other weights (what a replica that never got the
    adapter serves): the same proof fails, naming the probe and the token."""
    server = world.serve(world.other)
    targets = targets_for(server, tmp_path)
    config = CONFIGS["openai"]
    assert targets(config, world.candidate.id, world.candidate.uri) == world.candidate.id
    assert targets.prove(config, world.candidate.id, world.probes).verified
    with ModelServerClient(server.url, api_key=KEY) as client:
        client.load(MODEL, str(path_of(world.other)), inplace=True)
    with pytest.raises(DeployFailed, match=r"probe 0 \(task [0-9a-f]{12}\): token \d+: expected"):
        targets.prove(config, world.candidate.id, world.probes)


def test_no_probe_set_or_no_serving_target_is_noted_never_silent(
    world: World, tmp_path: Path
) -> None:
    targets = targets_for(world.serving_candidate, tmp_path)
    proof = targets.prove(CONFIGS["local"], world.candidate.id, None)
    assert not proof.verified and proof.note == NO_PROBE_SET == "not verified: no probe set"
    offline = targets.prove({"kind": "none"}, world.candidate.id, world.probes)
    assert offline.note == "not verified: the loop has no serving target"


def test_a_probe_set_of_another_checkpoint_proves_nothing(world: World) -> None:
    with (
        ModelServerClient(world.serving_candidate.url, api_key=KEY) as client,
        pytest.raises(DeployFailed, match="the probe set is of checkpoint"),
    ):
        prove_delivery(client, MODEL, world.probes, checkpoint_id=world.other.id)


def test_the_evaluation_records_each_tokens_lead_over_its_runner_up(world: World) -> None:
    """What a near tie is judged by (issue 43): the eval job's greedy margins, from its
    engine's top-2 log-probs."""
    for probe_ in world.probes.probes:
        sampled = [*probe_.token_ids, *([probe_.stop_id] if probe_.stop_id is not None else [])]
        assert probe_.margins is not None and probe_.runners_up is not None
        assert len(probe_.margins) == len(probe_.runners_up) == len(sampled)
        assert all(margin >= 0 for margin in probe_.margins)
        assert all(other != token for other, token in zip(probe_.runners_up, sampled, strict=True))


# The comparison itself, on answers of every shape a server may give ---------------------------


def probe(**fields: Any) -> Probe:
    base: dict[str, Any] = {
        "task_id": "t" * 64,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "max_tokens": 8,
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [10, 11],
        "stop_id": 99,
        "logprobs": [-0.5, -1.0, -0.1],
        "text": "ab",
    }
    return Probe(**{**base, **fields})


def answer(
    *,
    token_ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    text: str = "ab",
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": "x", "logprob": lp} for lp in logprobs]}
    out: dict[str, Any] = {"choices": [choice]}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    return out


def test_token_ids_match_with_or_without_the_stop_token() -> None:
    assert mismatch(probe(), answer(token_ids=[10, 11, 99], logprobs=[-0.5, -1.0, -0.1])) == ""
    assert mismatch(probe(), answer(token_ids=[10, 11], logprobs=[-0.5, -1.0])) == ""
    assert mismatch(probe(), answer(token_ids=[10, 12])) == "token 1: expected id 11, got id 12"
    assert mismatch(probe(), answer(token_ids=[10])) == "token 1: expected id 11, got the end"
    assert mismatch(probe(), answer(token_ids=[10, 11, 99, 5])) == (
        "token 3: expected the end, got id 5"
    )


def test_log_probs_match_within_the_tolerance_and_not_beyond() -> None:
    near = -1.0 + LOGPROB_ATOL * 0.9
    assert mismatch(probe(), answer(token_ids=[10, 11], logprobs=[-0.5, near])) == ""
    far = -1.0 + LOGPROB_ATOL * 1.5
    assert mismatch(probe(), answer(token_ids=[10, 11], logprobs=[-0.5, far])).startswith(
        "token 1: expected log-prob -1.0000, got -0.8500"
    )


def test_a_prompt_rendered_otherwise_or_a_text_only_answer() -> None:
    assert mismatch(probe(), answer(token_ids=[10, 11], prompt_ids=[1, 2, 4])) == (
        "the server rendered the prompt differently (prompt token 2)"
    )
    assert mismatch(probe(), answer(text="ab")) == ""  # a server with neither: the text
    assert mismatch(probe(), answer(text="ax")) == (
        "the completion's text differs from the candidate's at character 1"
    )
    assert mismatch(probe(), {"choices": []}) == "the answer has no choices"
