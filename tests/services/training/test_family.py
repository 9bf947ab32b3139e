"""The family interface: one GRPO and one SFT trainer for every family, a new family is one
registry entry, and what the interface promises about rollouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from services.environments.base import Environment, Episode, Reward, TaskSpec
from services.environments.chat import ChatEpisode
from services.environments.toolcalc import ToolcalcEnvironment
from services.training import family as family_module
from services.training.checkpoint import Manifest, save_checkpoint, verify_checkpoint
from services.training.config import GRPOConfig, HFGRPOConfig, HFSFTConfig, SFTConfig
from services.training.device import autocast
from services.training.distributed import init_distributed
from services.training.family import (
    DemonstrationOptions,
    FamilyModel,
    PackedBatch,
    Rollouts,
    TokenSequence,
    family_for,
    pack_turns,
    register_family,
)
from services.training.grpo import train_grpo
from services.training.rng import derive_seed, gumbel
from services.training.sft import train_sft
from services.training.tiny.family import demonstration_sequences
from services.training.tiny.model import TinyModel
from services.training.tokenizer import ByteTokenizer
from tests.services.training.conftest import run_train_job
from tests.services.training.hf_support import build_tiny_llama

TINY_SHAPE = {"max_seq_len": 160, "n_layer": 1, "n_head": 2, "d_model": 16}
GRPO_STEP = {
    "steps": 1,
    "tasks_per_step": 4,
    "group_size": 4,
    "max_new_tokens": 10,
    "max_turns": 2,
    "temperature": 1.5,
    "lr": 1e-2,
    "log_every": 0,
}
SFT_STEP = {"steps": 1, "batch_size": 4, "micro_batch": 2, "lr": 1e-2, "log_every": 0}


class VariedRewards(ToolcalcEnvironment):
    """toolcalc whose text and chat rewards vary even for an untrained model."""

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        total = (len({c for t in episode.agent_turns for c in t.text}) % 5) / 4
        return Reward(components={"distinct": total}, total=total, passed=total == 1.0)

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        total = (sum(len(c) for c in episode.completions) % 7) / 7
        return Reward(components={"length": total}, total=total, passed=total > 0.5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "model"
    build_tiny_llama(path)
    return path


def fresh_model(name: str, llama: Path, config: object) -> FamilyModel:
    """A model of family ``name`` every weight of which trains (hf: full fine-tuning, so a
    fresh LoRA's zero ``B`` cannot hide an ``A`` that does not move)."""
    cpu = torch.device("cpu")
    if name == "tiny":
        return family_for("tiny").create(TINY_SHAPE, seed=0, device=cpu)
    return family_for("hf").load(llama, device=cpu, training=config)


def configs(name: str) -> tuple[GRPOConfig, SFTConfig]:
    if name == "tiny":
        return GRPOConfig(**GRPO_STEP), SFTConfig(**SFT_STEP)
    return HFGRPOConfig(**GRPO_STEP, lora=False), HFSFTConfig(**SFT_STEP, lora=False)


def snapshot(model: FamilyModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.trainable_parameters()}


def unchanged(model: FamilyModel, before: Mapping[str, torch.Tensor]) -> list[str]:
    return [n for n, p in model.trainable_parameters() if torch.equal(p.detach(), before[n])]


@pytest.mark.parametrize("name", ["tiny", "hf"])
def test_one_grpo_trainer_moves_every_trainable_weight_of_each_family(
    name: str, tiny_llama: Path
) -> None:
    env = VariedRewards()
    tasks = env.generate_tasks(8, seed=0, api_version="v1")
    grpo, _ = configs(name)
    model = fresh_model(name, tiny_llama, grpo)
    assert model.family == name
    before = snapshot(model)
    result = train_grpo(model, env, tasks, grpo, ctx=init_distributed("cpu"))
    counters = result.counters
    assert counters.steps_done == 1 and counters.groups == 4 and counters.episodes == 16
    assert counters.filtered_zero_variance_groups < 4
    assert counters.rollout_tokens > 0 and counters.train_tokens > 0
    assert unchanged(model, before) == []


@pytest.mark.parametrize("name", ["tiny", "hf"])
def test_one_sft_trainer_moves_every_trainable_weight_of_each_family(
    name: str, tiny_llama: Path
) -> None:
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(6, seed=1, api_version="v1")
    _, sft = configs(name)
    model = fresh_model(name, tiny_llama, sft)
    sequences = model.demonstrations(env, tasks, DemonstrationOptions(seed=0))
    assert len(sequences) >= len(tasks) and all(any(mask) for _, mask in sequences)
    before = snapshot(model)
    result = train_sft(model, sequences, sft, ctx=init_distributed("cpu"))
    assert result.steps_done == 1 and result.train_tokens > 0
    assert result.final_loss is not None and result.final_loss > 0
    assert unchanged(model, before) == []


def test_hf_episodes_do_not_depend_on_their_batch(tiny_llama: Path) -> None:
    """Counter-based seeds: an episode samples the same tokens alone or beside others."""
    model = family_for("hf").load(tiny_llama, device=torch.device("cpu"))
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(3, seed=2, api_version="v1")
    options = {"max_turns": 2, "max_new_tokens": 8, "temperature": 1.0}
    together = model.rollouts(env, tasks, seeds=[11, 12, 13], **options)
    alone = model.rollouts(env, tasks[1:2], seeds=[12], **options)
    assert together.episodes[1].turns == alone.episodes[0].turns
    again = model.rollouts(env, tasks, seeds=[11, 12, 14], **options)
    assert again.episodes[:2] == together.episodes[:2]
    assert together.generated_tokens == sum(len(c) for e in together.episodes for _, c in e.turns)


def test_tiny_turns_pack_into_the_transcript_the_demonstrations_train_on() -> None:
    """A text episode's token turns are exactly its transcript, the agent's bytes as targets."""
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(4, seed=3, api_version="v2")
    demos = {t.prompt: env.demonstration(t) for t in tasks}

    class Replay(TinyModel):
        def generate(self, prompts, *, max_new_tokens=32, temperature=0.0, seed=0):  # type: ignore[no-untyped-def]
            out = []
            for prompt in prompts:
                demo = next(d for p, d in demos.items() if prompt.startswith(p))
                out.append(demo.agent_turns[prompt.count("\n> ") - 1].text)
            return out

    torch.manual_seed(0)
    tiny = family_for("tiny").create({"max_seq_len": 2048}, seed=0, device=torch.device("cpu"))
    replay = Replay(tiny.net)  # type: ignore[attr-defined]
    rollouts = replay.rollouts(
        env, tasks, seeds=[0] * 4, max_turns=5, max_new_tokens=256, temperature=0.0
    )
    expected = demonstration_sequences(list(demos.values()), ByteTokenizer(), max_seq_len=2048)
    assert [e.sequences for e in rollouts.episodes] == [[s] for s in expected]
    assert all(e.reward.passed for e in rollouts.episodes)


def test_pack_turns_merges_only_where_the_prefix_agrees() -> None:
    turns = [([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6]), ([9], [7])]
    assert pack_turns(turns) == [
        ([1, 2, 3, 4, 5, 6], [False, False, True, True, False, True]),
        ([9, 7], [False, True]),
    ]


def test_an_unknown_family_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model family 'big'; known: hf, tiny"):
        family_for("big")


def test_a_spec_whose_family_disagrees_with_its_base_fails_with_one_line(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    from services.environments import write_task_file

    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(2, seed=0, api_version="v1"))
    for family, base, message in (
        ("tiny", tiny_llama, "spec 'family' is 'tiny' but the base checkpoint's family is 'hf'"),
        ("big", tiny_llama, "unknown model family 'big' in the spec; known: hf, tiny"),
        ("hf", None, "hf training needs a base checkpoint"),
    ):
        code = run_train_job(
            tmp_path / family,
            algorithm="sft",
            environment="toolcalc",
            dataset=tasks,
            base_checkpoint=base,
            family=family,
            hyperparameters={"steps": 1},
        )
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("ratchet job: ") and message in err[-1], err[-1]


# --- a second family, registered by the test with one entry ------------------------------


class Bigram(nn.Module):
    """A byte bigram model: logits of the next byte are a row of one table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)
        self.bias = nn.Parameter(torch.zeros(256))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids) + self.bias  # (N, T, V)


class BigramConfig:
    def to_dict(self) -> dict[str, Any]:
        return {"architecture": "test-bigram"}


class BigramModel:
    """The test family's model: text rollouts through the tiny family's loop."""

    family = "bigram"
    pad_id = 0

    def __init__(self, net: Bigram, device: torch.device) -> None:
        self.net, self.device, self.checkpoint_id = net.to(device), device, None
        self.tokenizer = ByteTokenizer()

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.net.named_parameters())

    def train(self, mode: bool = True) -> None:
        self.net.train(mode)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: Sequence[int],
    ) -> list[str]:
        seeds = torch.tensor(list(seed), dtype=torch.int64)
        last = torch.tensor([self.tokenizer.encode(p)[-1] for p in prompts])  # (B,)
        rows: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for t in range(max_new_tokens):
            logits = self.net(last[:, None])[:, -1].double()  # (B, V)
            last = (logits / temperature + gumbel(seeds, t, 256)).argmax(dim=-1)  # (B,)
            for b, token in enumerate(last.tolist()):
                if not done[b]:
                    done[b] = token == self.tokenizer.stop_id
                    if not done[b]:
                        rows[b].append(token)
        return [self.tokenizer.decode(r) for r in rows]

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,  # lockstep: every row at once
    ) -> Rollouts:
        from services.training.family import TokenEpisode
        from services.training.tiny.rollout import run_episodes

        rollouts, stats = run_episodes(
            env,
            tasks,
            self,
            seeds=[derive_seed(s, 7) for s in seeds],
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            context_limit=4096,
        )
        episodes = [
            TokenEpisode(t, r.turns, env.verify(t, r.episode), r.episode.end_reason, None)
            for t, r in zip(tasks, rollouts, strict=True)
        ]
        return Rollouts(episodes, stats.generated_tokens, stats.prompt_tokens)

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        with autocast(self.device):
            logp = torch.log_softmax(self.net(batch.ids[:, :-1]).float(), dim=-1)  # (N, T-1, V)
        return logp.gather(-1, batch.ids[:, 1:, None]).squeeze(-1)  # (N, T-1)

    def demonstrations(
        self, env: Environment, tasks: Sequence[TaskSpec], options: DemonstrationOptions
    ) -> list[TokenSequence]:
        episodes = env.demonstrations(tasks, seed=options.seed)
        return demonstration_sequences(episodes, self.tokenizer, max_seq_len=4096)

    def save(self, out_dir: Path, *, parent: str | None, metadata: dict[str, object]) -> Manifest:
        return save_checkpoint(self.net, BigramConfig(), out_dir, parent=parent, metadata=metadata)


class BigramFamily:
    name = "bigram"
    eval_defaults: Mapping[str, int] = {"max_new_tokens": 12}

    def load(
        self,
        path: Path,
        *,
        device: torch.device,
        base_dir: Path | None = None,
        training: object | None = None,
    ) -> BigramModel:
        raise ValueError("the test family has no checkpoints to load")

    def create(
        self, shape: Mapping[str, object] | None, *, seed: int, device: torch.device
    ) -> BigramModel:
        torch.manual_seed(seed)
        return BigramModel(Bigram(), device)


def test_a_new_family_plugs_in_with_one_registry_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(family_module, "_REGISTRY", dict(family_module._REGISTRY))
    register_family("bigram", BigramFamily)  # the one entry

    model = family_for("bigram").create(None, seed=0, device=torch.device("cpu"))
    env = VariedRewards()
    tasks = env.generate_tasks(8, seed=0, api_version="v1")
    before = snapshot(model)
    sft = train_sft(
        model,
        model.demonstrations(env, tasks, DemonstrationOptions()),
        SFTConfig(**SFT_STEP),
        ctx=init_distributed("cpu"),
    )
    grpo = train_grpo(model, env, tasks, GRPOConfig(**GRPO_STEP), ctx=init_distributed("cpu"))
    assert sft.steps_done == 1 and grpo.counters.steps_done == 1
    assert grpo.counters.filtered_zero_variance_groups < 4
    assert unchanged(model, before) == []
    manifest = model.save(tmp_path / "ckpt", parent=None, metadata={"algorithm": "grpo"})
    assert verify_checkpoint(tmp_path / "ckpt").checkpoint_id == manifest.checkpoint_id
    assert family_module.family_names() == ["bigram", "hf", "tiny"]


def test_an_hf_grpo_job_resumes_from_its_last_point_to_the_same_adapter(
    tmp_path: Path,
) -> None:
    """Resume points hold the trainable weights of any family: an hf LoRA job restarted
    from step 1 of 2 ends with the adapter the uninterrupted job wrote."""
    import shutil

    from services.artifacts import ArtifactStore
    from services.checkpoints import install_checkpoint
    from services.environments import write_task_file
    from services.training.checkpoint import read_manifest
    from tests.services.training.conftest import read_metrics

    store = ArtifactStore(tmp_path / "store")
    build_tiny_llama(tmp_path / "llama")
    base = install_checkpoint(tmp_path / "llama", store).target
    tasks = tmp_path / "tasks.jsonl"
    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(4, seed=4, api_version="v2"))
    hyper = {**GRPO_STEP, "steps": 2, "tasks_per_step": 2, "sft_coef": 0.5, "checkpoint_every": 1}
    spec = {"algorithm": "grpo", "dataset": tasks, "base_checkpoint": base}
    spec["hyperparameters"] = hyper
    assert run_train_job(tmp_path / "run", **spec) == 0
    out = tmp_path / "run" / "out"
    first = read_metrics(tmp_path / "run")
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-000001", "step-000002"]
    # a kill after step 1's point: later outputs gone
    shutil.rmtree(out / "state" / "step-000002")
    shutil.rmtree(out / "checkpoint")
    (out / "metrics.json").unlink()
    assert run_train_job(tmp_path / "run", **spec) == 0
    resumed = read_metrics(tmp_path / "run")
    assert resumed["resumed_from_step"] == 1 and first["resumed_from_step"] == 0
    assert resumed["checkpoint_id"] == first["checkpoint_id"]
    assert read_manifest(out / "checkpoint").kind == "lora"
    for key in ("rollout_tokens", "train_tokens", "episodes", "history"):
        assert resumed[key] == first[key], key


def test_starting_weights_score_under_the_kept_weights_and_put_the_current_back() -> None:
    from services.training.family import StartingWeights, collate

    model = family_for("tiny").create(TINY_SHAPE, seed=0, device=torch.device("cpu"))
    batch = collate([([1, 2, 3, 4], [False, True, True, True])], pad_id=0, device=model.device)
    with torch.no_grad():
        at_start = model.logprobs(batch)
    kept = StartingWeights(model)
    with torch.no_grad():
        for _, param in model.trainable_parameters():
            param.add_(0.05)
        moved = model.logprobs(batch)
    assert not torch.equal(moved, at_start)
    torch.testing.assert_close(kept.logprobs(model, batch), at_start, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.logprobs(batch), moved, rtol=0, atol=0)


@pytest.mark.slow
def test_hf_grpo_on_two_torchrun_ranks_matches_one_process(tmp_path: Path) -> None:
    """Per-episode seeds: an hf GRPO step samples the same episodes on one rank or two, so
    the adapters agree (the trainer this replaced seeded per rank)."""
    from safetensors.torch import load_file

    from services.artifacts import ArtifactStore
    from services.checkpoints import install_checkpoint
    from services.environments import write_task_file
    from tests.services.training.conftest import (
        job_command,
        read_metrics,
        run_job_process,
        torchrun_job_command,
        write_train_spec,
    )

    build_tiny_llama(tmp_path / "llama")
    base = install_checkpoint(tmp_path / "llama", ArtifactStore(tmp_path / "store")).target
    tasks = tmp_path / "tasks.jsonl"
    write_task_file(tasks, ToolcalcEnvironment().generate_tasks(4, seed=4, api_version="v2"))
    hyper = {**GRPO_STEP, "tasks_per_step": 2, "sft_coef": 0.5, "threads": 1}
    for name, command in (("single", job_command), ("ddp", torchrun_job_command)):
        spec = write_train_spec(
            tmp_path / name,
            algorithm="grpo",
            dataset=tasks,
            base_checkpoint=base,
            hyperparameters=hyper,
        )
        run_job_process(command(spec), timeout=600)
    one, two = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "ddp")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for key in ("rollout_tokens", "train_tokens", "episodes", "groups"):
        assert one[key] == two[key], key
    a = load_file(str(tmp_path / "single" / "out" / "checkpoint" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "ddp" / "out" / "checkpoint" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)
