"""Issue 44 item 3, against a real ``ratchet serve`` process: rollouts another engine
sampled with slightly other weights than the trainer's are reported (the mean K3, the
largest ratio, the version the server says decoded) and corrected (GRPO's loss is the one
with the capped importance weights); rft reports it per rollout call in metrics.json; and a
server that decodes with the wrong adapter stops the job with a reason naming it.

The other weights reach the server the way they would in a cluster: the job publishes its
adapter into the shared directory and the server loads it from there. The test changes
what lands there (noise on the weights written, or another adapter's files over them), as
a stale copy on a shared volume would, and the server decodes with whatever it loaded."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from services.environments import write_task_file
from services.environments.base import Reward, TaskSpec
from services.environments.chat import ChatEpisode
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.remote import attach_rollout_backend
from services.serving.base import CheckpointRef
from services.training.checkpoint import Manifest, read_manifest
from services.training.config import HFGRPOConfig
from services.training.distributed import init_distributed
from services.training.family import TokenEpisode, collate
from services.training.grpo import group_advantages, policy_loss, train_grpo
from services.training.hf.family import HFFamily, HFFamilyModel
from services.training.job import train_job_main
from services.training.jobspec import EXIT_FAILED
from services.training.mismatch import tis_weights
from tests.services.modelserver.conftest import ServeProcess, path_of
from tests.services.training.conftest import read_metrics, write_train_spec

NOISE = 0.01  # on the published adapter's weights: a small, real disagreement
T = TypeVar("T")


class VariedChatRewards(ToolcalcEnvironment):
    """toolcalc whose chat reward varies with the answer's length, so an untrained model's
    groups have variance and GRPO trains on them."""

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        total = (sum(len(c) for c in episode.completions) % 7) / 7
        return Reward(components={"length": total}, total=total, passed=total > 0.5)


@pytest.fixture(scope="module")
def server(
    llama_with_adapters: list[CheckpointRef], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """``ratchet serve`` on the random llama; adapters load from the directory above it."""
    log = tmp_path_factory.mktemp("mismatch") / "serve.log"
    served = ServeProcess(path_of(llama_with_adapters[0]), name="base", log=log)
    yield served
    served.stop()


class Recorder:
    """A keeper that keeps every episode the trainer hands it, as sampled."""

    def __init__(self) -> None:
        self.episodes: list[TokenEpisode] = []

    def add(self, episodes: Sequence[TokenEpisode]) -> None:
        self.episodes.extend(episodes)


def with_noise(model: HFFamilyModel, seed: int, write: Callable[[], T]) -> T:
    """``write()`` (a publish) with a little noise on the trainable weights: the server
    decodes with weights slightly off the trainer's, whose own are put back after."""
    params = [p for _, p in model.trainable_parameters()]
    kept = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * NOISE)
    try:
        return write()
    finally:
        with torch.no_grad():
            for param, value in zip(params, kept, strict=True):
                param.copy_(value)


def test_a_slightly_different_sampler_is_reported_and_corrected(
    llama_with_adapters: list[CheckpointRef], server: ServeProcess
) -> None:
    base_dir = path_of(llama_with_adapters[0])
    config = HFGRPOConfig(
        steps=1,
        tasks_per_step=2,
        group_size=4,
        max_turns=2,
        max_new_tokens=6,
        micro_batch=64,
        log_every=0,
        checkpoint_every=0,
        tis_cap=1.0,  # every token the trainer likes more than the sampler did is capped
    )  # the default mismatch_threshold: a disagreement this small is reported, not stopped
    torch.manual_seed(0)
    model = HFFamily().load(base_dir, device=torch.device("cpu"), training=config)
    shared = {"url": server.url, "model": "base", "shared_dir": str(base_dir.parent)}
    attach_rollout_backend(model, shared, {})
    remote = model.chat.remote
    assert remote is not None and remote.publish is not None
    publish, published = remote.publish, []

    def noisy(out_dir: Path) -> object:
        published.append(with_noise(model, 1, lambda: publish(out_dir)))
        return published[-1]

    remote.publish = noisy
    start = [p.detach().clone() for _, p in model.trainable_parameters()]
    recorder = Recorder()
    env = VariedChatRewards()
    tasks = env.generate_tasks(2, seed=3, api_version="v1")

    result = train_grpo(model, env, tasks, config, ctx=init_distributed("cpu"), keeper=recorder)

    (row,) = result.sampler_mismatch
    step = result.counters.history[0]
    assert row["where"] == "step 1" and row["tokens"] > 0
    assert 0.0 < row["k3"] < config.mismatch_threshold and row["max_ratio"] > 1.0
    assert 0.0 < row["truncated_fraction"] < 1.0
    assert step["mismatch_k3"] == row["k3"] and step["tis_truncated_fraction"] > 0
    # the server's word for what decoded: the (noisy) adapter the job published
    (manifest,) = published
    assert isinstance(manifest, Manifest) and row["served"] == manifest.checkpoint_id

    # corrected: the step's loss is GRPO's with the capped ratios, recomputed from the
    # sampled episodes under the weights that sampled them
    assert step["groups_kept"] > 0
    expected, plain = expected_losses(model, recorder.episodes, start, config)
    assert step["loss"] == pytest.approx(expected, abs=1e-5)
    assert abs(expected - plain) > 5e-5  # the weights changed the loss: the check has teeth


def expected_losses(
    model: HFFamilyModel,
    episodes: list[TokenEpisode],
    start: list[torch.Tensor],
    config: HFGRPOConfig,
) -> tuple[float, float]:
    """GRPO's first-step loss of ``episodes`` under the ``start`` weights, with and without
    the truncated importance weights."""
    with torch.no_grad():
        for (_, param), value in zip(model.trainable_parameters(), start, strict=True):
            param.copy_(value)
    rewards = torch.tensor([e.reward.total for e in episodes]).view(-1, config.group_size)
    advantages, keep = group_advantages(rewards, eps=config.adv_eps)
    sequences, values, adv = [], [], []
    for index, episode in enumerate(episodes):
        if bool(keep[index // config.group_size]):
            laid = episode.sampler_sequences
            assert laid is not None  # the server's log-probs came back with the tokens
            sequences.extend(episode.sequences)
            values.extend(laid)
            adv.extend([float(advantages.view(-1)[index])] * len(episode.sequences))
    batch = collate(sequences, pad_id=model.pad_id, device=model.device, sampler=values)
    assert batch.sampler_logp is not None
    tokens = float(batch.target.sum())
    model.train()
    with torch.no_grad():
        logp = model.logprobs(batch)
    weights = tis_weights(logp, batch.sampler_logp, config.tis_cap)
    losses = [
        policy_loss(
            logp,
            logp,
            torch.tensor(adv),
            batch.target,
            clip_eps=config.clip_eps,
            normalizer=tokens,
            importance=importance,
        )[0]
        for importance in (weights, None)
    ]
    return float(losses[0]), float(losses[1])


def test_rft_reports_each_rounds_mismatch_in_metrics(
    llama_with_adapters: list[CheckpointRef],
    server: ServeProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base_dir = path_of(llama_with_adapters[0])
    original = HFFamilyModel._publish

    def noisy(self: HFFamilyModel, out_dir: Path) -> Manifest:
        return with_noise(self, 2, lambda: original(self, out_dir))

    monkeypatch.setattr(HFFamilyModel, "_publish", noisy)
    code = run_remote_job(
        tmp_path,
        base_dir,
        server,
        algorithm="rft",
        hyperparameters={
            "samples_per_task": 2,
            "rollout_batch": 2,
            "max_turns": 2,
            "max_new_tokens": 6,
            "steps": 1,
            "replay_fraction": 0.0,
            "mismatch_threshold": 10.0,
        },
    )
    assert code == 0
    rows = read_metrics(tmp_path)["sampler_mismatch"]
    assert [r["where"] for r in rows] == ["rollouts 1"]  # 4 episodes, 2 rows: one round
    for row in rows:
        assert row["tokens"] > 0 and 0.0 < row["k3"] < 10.0
        assert len(row["served"]) == 64


def test_a_server_decoding_with_the_wrong_adapter_stops_the_job(
    llama_with_adapters: list[CheckpointRef],
    server: ServeProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base_dir = path_of(llama_with_adapters[0])
    wrong = another_adapter(base_dir, tmp_path / "another")
    wrong_id = read_manifest(wrong).checkpoint_id
    original = HFFamilyModel._publish
    sent: list[str] = []

    def stale(self: HFFamilyModel, out_dir: Path) -> Manifest:
        manifest = original(self, out_dir)  # the trainer's adapter, as it writes it
        sent.append(manifest.checkpoint_id)
        shutil.rmtree(out_dir)
        shutil.copytree(wrong, out_dir)  # what the server finds there instead
        return manifest

    monkeypatch.setattr(HFFamilyModel, "_publish", stale)
    code = run_remote_job(
        tmp_path,
        base_dir,
        server,
        algorithm="grpo",
        hyperparameters={
            "steps": 2,
            "tasks_per_step": 2,
            "group_size": 2,
            "max_turns": 2,
            "max_new_tokens": 6,
            "log_every": 0,
        },
    )

    assert code == EXIT_FAILED
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("ratchet job: sampler mismatch at step 1: mean K3 ")
    assert "above mismatch_threshold 0.01" in last
    assert f"served version {wrong_id[:12]} as 'ratchet-rollout-" in last
    assert f"(the job sent checkpoint {sent[0][:12]})" in last
    assert not (tmp_path / "out" / "metrics.json").exists()  # stopped before it trained


def another_adapter(base_dir: Path, out_dir: Path) -> Path:
    """Another LoRA adapter on the same base, trained elsewhere: random weights, on the
    output head too (the random base's small head keeps its distribution near uniform
    whatever its layers do), so the answers move well away from the base's."""
    torch.manual_seed(7)
    config = HFGRPOConfig(lora_target_modules=("q_proj", "v_proj", "lm_head"))
    model = HFFamily().load(base_dir, device=torch.device("cpu"), training=config)
    with torch.no_grad():
        for _, param in model.trainable_parameters():
            param.normal_(0.0, 1.0)
    model.save(out_dir, parent=None, metadata={"trained": "elsewhere"})
    return out_dir


def run_remote_job(
    root: Path,
    base_dir: Path,
    server: ServeProcess,
    *,
    algorithm: str,
    hyperparameters: dict[str, Any],
) -> int:
    """A train job of ``algorithm`` on the base, rolling out on ``server``; its exit code."""
    tasks = root / "tasks.jsonl"
    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(2, seed=3, api_version="v1"))
    spec = write_train_spec(
        root,
        algorithm=algorithm,
        environment="toolcalc",
        dataset=tasks,
        base_checkpoint=base_dir,
        hyperparameters={**hyperparameters, "threads": 1},
        rollout_backend={"url": server.url, "model": "base", "shared_dir": str(base_dir.parent)},
    )
    return train_job_main(["--spec", str(spec)])
