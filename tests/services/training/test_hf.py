"""The hf family end to end on a tiny random Llama: jobs, adapters, merge, tampering, specs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.environments import write_task_file
from services.environments.base import Reward, TaskSpec
from services.environments.chat import ChatEpisode
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.inference.utilisation import TIME_PARTS
from services.training.checkpoint import (
    CheckpointError,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from services.training.hf.checkpoint import load_hf_checkpoint, merge_adapter
from tests.services.training.conftest import (
    job_command,
    read_metrics,
    run_job_process,
    run_train_job,
    torchrun_job_command,
    write_spec,
    write_train_spec,
)
from tests.services.training.hf_support import build_tiny_llama

SFT_HYPER = {"steps": 4, "batch_size": 4, "micro_batch": 4, "lr": 5e-3, "log_every": 0}
GRPO_HYPER = {
    "steps": 2,
    "tasks_per_step": 2,
    "group_size": 2,
    "max_turns": 2,
    "max_new_tokens": 8,
    "lr": 1e-3,
    "log_every": 0,
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    return ArtifactStore(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def tiny_llama(store: ArtifactStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama installed in the store, as `ratchet models import` would."""
    source = tmp_path_factory.mktemp("llama") / "model"
    build_tiny_llama(source)
    return install_checkpoint(source, store).target


@pytest.fixture(scope="module")
def chat_tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-tasks")
    env = ToolcalcEnvironment()
    files = {}
    for version in ("v1", "v2"):
        files[version] = root / f"{version}.jsonl"
        write_task_file(files[version], env.generate_tasks(6, seed=4, api_version=version))
    return files


@pytest.fixture(scope="module")
def sft_adapter(
    tiny_llama: Path,
    chat_tasks: dict[str, Path],
    store: ArtifactStore,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    root = tmp_path_factory.mktemp("sft")
    code = run_train_job(
        root,
        algorithm="sft",
        dataset=chat_tasks["v1"],
        base_checkpoint=tiny_llama,
        hyperparameters={**SFT_HYPER, "lora_r": 4, "lora_alpha": 8},
    )
    assert code == 0
    return install_checkpoint(root / "out" / "checkpoint", store).target


def test_sft_lora_job_writes_an_adapter_naming_its_base(
    sft_adapter: Path, tiny_llama: Path
) -> None:
    manifest = verify_checkpoint(sft_adapter)
    base = read_manifest(tiny_llama)
    assert manifest.family == "hf" and manifest.kind == "lora"
    assert sorted(manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert manifest.base is not None
    assert manifest.base.checkpoint_id == base.checkpoint_id == manifest.base.sha256
    assert manifest.parent == base.checkpoint_id
    config = json.loads((sft_adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == f"ratchet:{base.checkpoint_id}"
    assert config["r"] == 4


def test_the_same_training_gives_the_same_adapter_id_in_any_process(
    tiny_llama: Path, chat_tasks: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint id is its content's hash: peft's target-module set, written in each
    process's hash order, must not make two identical runs two checkpoints."""
    ids = []
    for hash_seed in ("1", "2"):
        root = tmp_path / f"hash-seed-{hash_seed}"
        spec = write_train_spec(
            root,
            algorithm="sft",
            dataset=chat_tasks["v1"],
            base_checkpoint=tiny_llama,
            hyperparameters={**SFT_HYPER, "steps": 1, "lora_r": 4, "lora_alpha": 8},
        )
        run_job_process(job_command(spec), env={"PYTHONHASHSEED": hash_seed})
        config = json.loads((root / "out" / "checkpoint" / "adapter_config.json").read_text())
        assert config["target_modules"] == sorted(config["target_modules"])
        ids.append(read_manifest(root / "out" / "checkpoint").checkpoint_id)
    assert ids[0] == ids[1]


def test_sft_lowers_the_loss(tiny_llama: Path, chat_tasks: dict[str, Path], tmp_path: Path) -> None:
    code = run_train_job(
        tmp_path,
        algorithm="sft",
        dataset=chat_tasks["v1"],
        base_checkpoint=tiny_llama,
        hyperparameters={**SFT_HYPER, "steps": 5, "lora": False, "lr": 1e-2},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    losses = [row["loss"] for row in metrics["history"]]
    assert losses[-1] < losses[0]
    assert metrics["train_mfu"] > 0 and metrics["peak_gflops"]["train"] > 0
    assert metrics["rollout_mfu"] is None  # SFT samples nothing
    assert metrics["family"] == "hf" and metrics["train_tokens"] > 0
    manifest = verify_checkpoint(tmp_path / "out" / "checkpoint")
    assert manifest.kind == "full" and "model.safetensors" in manifest.files


def test_grpo_lora_job_continues_the_champion_adapter(
    sft_adapter: Path, tiny_llama: Path, chat_tasks: dict[str, Path], tmp_path: Path
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm="grpo",
        dataset=chat_tasks["v2"],
        base_checkpoint=sft_adapter,
        hyperparameters={**GRPO_HYPER, "kl_coef": 0.05},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 2 and metrics["episodes"] == 8
    assert metrics["rollout_tokens"] > 0
    assert metrics["rollout_mfu"] > 0 and metrics["peak_gflops"]["rollout"] > 0
    assert set(metrics["time_split"]) == set(TIME_PARTS)
    assert metrics["time_split"]["forward"] > 0
    assert metrics["parent_checkpoint_id"] == read_manifest(sft_adapter).checkpoint_id
    manifest = verify_checkpoint(tmp_path / "out" / "checkpoint")
    assert manifest.kind == "lora"
    assert manifest.base is not None
    assert manifest.base.checkpoint_id == read_manifest(tiny_llama).checkpoint_id


def test_grpo_step_changes_every_adapter_weight(
    sft_adapter: Path, chat_tasks: dict[str, Path]
) -> None:
    from services.environments import read_task_file
    from services.training.config import HFGRPOConfig
    from services.training.distributed import init_distributed
    from services.training.grpo import train_grpo
    from services.training.hf.family import HFFamily

    config = HFGRPOConfig(**{**GRPO_HYPER, "steps": 1, "group_size": 4, "temperature": 1.5})
    trainee = HFFamily().load(sft_adapter, device=torch.device("cpu"), training=config)
    model = trainee.module
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert before and all("lora_" in n for n in before)
    env = LengthRewardToolcalc()
    result = train_grpo(
        trainee,
        env,
        read_task_file(chat_tasks["v1"]),
        config,
        ctx=init_distributed("cpu"),
    ).counters
    after = dict(model.named_parameters())
    assert result.history[0]["groups_kept"] == 2
    changed = {n for n, p in before.items() if not torch.equal(p, after[n].detach())}
    assert changed == set(before)


class LengthRewardToolcalc(ToolcalcEnvironment):
    """toolcalc whose chat reward varies with the completion (a random model never passes)."""

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        total = (sum(len(c) for c in episode.completions) % 7) / 7
        return Reward(components={"length": total}, total=total, passed=total > 0.5)


def test_eval_job_on_an_adapter_writes_per_task_results(
    sft_adapter: Path, chat_tasks: dict[str, Path], tmp_path: Path
) -> None:
    spec = write_spec(
        tmp_path / "spec.json",
        kind="eval",
        checkpoint=str(sft_adapter),
        dataset=str(chat_tasks["v1"]),
        output_dir=str(tmp_path / "out"),
        hyperparameters={"max_new_tokens": 8, "max_turns": 2},
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 6
    assert set(rows[0]) >= {"task_id", "passed", "reward", "components", "turns", "end_reason"}
    assert set(rows[0]["components"]) == {"syntax", "tools", "answer"}
    metrics = read_metrics(tmp_path)
    assert (
        metrics["n"] == 6 and metrics["checkpoint_id"] == read_manifest(sft_adapter).checkpoint_id
    )
    assert 0.0 <= metrics["ci_low"] <= metrics["pass_rate"] <= metrics["ci_high"] <= 1.0


def test_adapter_loads_with_an_explicit_base_and_merges_to_the_same_model(
    sft_adapter: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "adapter"
    shutil.copytree(sft_adapter, elsewhere)
    with pytest.raises(CheckpointError, match="not found"):
        load_hf_checkpoint(elsewhere)
    adapter = load_hf_checkpoint(elsewhere, base_dir=tiny_llama)
    merged_manifest = merge_adapter(elsewhere, tmp_path / "merged", base_dir=tiny_llama)
    assert merged_manifest.kind == "full"
    assert merged_manifest.parent == read_manifest(sft_adapter).checkpoint_id
    merged = load_hf_checkpoint(tmp_path / "merged")
    ids = torch.tensor([[0, 5, 9, 17, 33, 64]])
    with torch.no_grad():
        a = adapter.model(input_ids=ids).logits
        b = merged.model(input_ids=ids).logits
        base = load_hf_checkpoint(tiny_llama).model(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, base, atol=1e-4)


def test_an_adapter_on_the_wrong_base_is_refused(sft_adapter: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    build_tiny_llama(other, seed=1)
    with pytest.raises(CheckpointError, match="expected"):
        load_hf_checkpoint(sft_adapter, base_dir=other)


def test_tampered_files_are_refused(tiny_llama: Path, sft_adapter: Path, tmp_path: Path) -> None:
    for source, name in (
        (tiny_llama, "tokenizer_config.json"),
        (sft_adapter, "adapter_model.safetensors"),
    ):
        copy = tmp_path / source.name
        shutil.copytree(source, copy)
        data = bytearray((copy / name).read_bytes())
        data[-2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=f"{name}.*tampered"):
            verify_checkpoint(copy)
        with pytest.raises(CheckpointError, match="tampered"):
            load_hf_checkpoint(copy, base_dir=tiny_llama)


def test_pickle_weights_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin .*pickle.*safetensors"):
        write_manifest(model_dir, family="hf")
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["files"]["pytorch_model.bin"] = {"sha256": "0" * 64, "size": 1}
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="pickle"):
        verify_checkpoint(model_dir)


def test_symlinks_in_job_output_are_never_followed(tiny_llama: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("RATCHET_DATABASE_URL=postgresql://u:hunter2@db/ratchet")
    out = tmp_path / "job-output"
    shutil.copytree(tiny_llama, out)
    (out / "environ").symlink_to(secret)  # not in the manifest: never copied
    store = ArtifactStore(tmp_path / "store")
    installed = install_checkpoint(out, store)
    assert not (installed.target / "environ").exists()
    assert sorted(p.name for p in installed.target.iterdir()) == sorted(
        [*read_manifest(out).files, "manifest.json"]
    )
    listed = tmp_path / "listed"
    shutil.copytree(tiny_llama, listed)
    (listed / "tokenizer_config.json").unlink()
    (listed / "tokenizer_config.json").symlink_to(tiny_llama / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match="symlink"):
        install_checkpoint(listed, ArtifactStore(tmp_path / "store2"))
    with pytest.raises(CheckpointError, match="symlink"):
        write_manifest(listed, family="hf")


def test_an_adapter_without_its_base_in_the_store_is_not_installed(
    sft_adapter: Path, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match="not in the store: import it first"):
        install_checkpoint(sft_adapter, ArtifactStore(tmp_path / "empty-store"))


@pytest.mark.parametrize(
    ("algorithm", "hyper", "message"),
    [
        ("sft", {"steps": 2, "bogus": 1}, "unknown hyperparameter.*bogus"),
        ("sft", {"lora_r": 0}, "lora_r must be >= 1"),
        ("sft", {"lora_target_modules": 3}, "lora_target_modules must be a list"),
        ("sft", {"lora_target_modules": ["no_such_module"]}, "cannot attach LoRA"),
        ("sft", {"lr": "fast"}, "lr must be a number"),
        ("sft", {"steps": 1.5}, "steps must be an integer"),
        ("sft", {"lora": "yes"}, "lora must be true or false"),
        ("sft", {"lr": 0}, r"lr must be > 0"),
        ("sft", {"augment_fraction": 0.5}, "unknown hyperparameter.*augment_fraction"),
        ("sft", {"recovery_fraction": 1.5}, r"recovery_fraction must be in \[0, 1\]"),
        ("grpo", {"recovery_fraction": 0.5}, "unknown hyperparameter.*recovery_fraction"),
        ("grpo", {"group_size": 1}, "group_size must be >= 2"),
    ],
)
def test_bad_hf_specs_fail_with_one_clear_line(
    tiny_llama: Path,
    chat_tasks: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    algorithm: str,
    hyper: dict[str, object],
    message: str,
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm=algorithm,
        dataset=chat_tasks["v1"],
        base_checkpoint=tiny_llama,
        hyperparameters=hyper,
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ratchet job: ")
    import re

    assert re.search(message, err[-1]), err[-1]
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_the_keys_a_profile_accepts_are_the_trainers_fields() -> None:
    from dataclasses import fields

    from services.training.config import HFGRPOConfig, HFSFTConfig, known_keys

    for algorithm, config_cls in (("sft", HFSFTConfig), ("grpo", HFGRPOConfig)):
        trainer_keys = {f.name for f in fields(config_cls)} - {"seed"}
        assert known_keys("hf", algorithm) == trainer_keys | {"threads"}


def test_a_training_profile_for_hf_refuses_unknown_hyperparameters() -> None:
    from pydantic import ValidationError

    from services.loop.policies import TrainingProfile

    profile = TrainingProfile.model_validate(
        {"family": "hf", "algorithm": "grpo", "hyperparameters": {"lora_r": 8, "group_size": 4}}
    )
    assert profile.family == "hf"
    with pytest.raises(ValidationError, match=r"unknown hyperparameter.*augment_fraction"):
        TrainingProfile.model_validate(
            {"family": "hf", "algorithm": "sft", "hyperparameters": {"augment_fraction": 0.5}}
        )


def test_recovery_demonstrations_add_context_not_targets(tiny_llama: Path) -> None:
    from services.training.hf.model import HFModel
    from services.training.hf.rollout import demonstration_sequences

    loaded = load_hf_checkpoint(tiny_llama)
    policy = HFModel(loaded.model, loaded.tokenizer, device=torch.device("cpu"))
    env = ToolcalcEnvironment()
    tasks = env.generate_tasks(12, seed=6, api_version="v1")
    plain = demonstration_sequences(env, tasks, policy)
    recovering = demonstration_sequences(env, tasks, policy, recovery_fraction=1.0)
    assert len(recovering) == len(plain)
    for (ids, mask), (slip_ids, slip_mask) in zip(plain, recovering, strict=True):
        assert len(slip_ids) > len(ids)
        targets = [token for token, is_target in zip(ids, mask, strict=True) if is_target]
        slip_targets = [t for t, is_target in zip(slip_ids, slip_mask, strict=True) if is_target]
        assert slip_targets == targets
    half = demonstration_sequences(env, tasks, policy, recovery_fraction=0.5, seed=1)
    assert half == demonstration_sequences(env, tasks, policy, recovery_fraction=0.5, seed=1)
    assert 0 < sum(a != b for a, b in zip(half, plain, strict=True)) < len(tasks)
    with pytest.raises(ValueError, match="recovery_fraction"):
        demonstration_sequences(env, tasks, policy, recovery_fraction=-0.1)


def test_logprobs_of_kept_positions_equal_the_full_computation(tiny_llama: Path) -> None:
    from services.training.hf.family import sequence_logprobs

    model = load_hf_checkpoint(tiny_llama).model
    ids = torch.tensor([[0, 5, 9, 17, 33, 64, 3], [0, 7, 7, 8, 2, 2, 2]])
    attention = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    target = torch.zeros((2, 6), dtype=torch.bool)
    target[0, 4:] = True
    target[1, 1:3] = True
    with torch.no_grad():
        full = sequence_logprobs(model, ids, attention)
        kept = sequence_logprobs(model, ids, attention, target)
    torch.testing.assert_close(kept[target], full[target], atol=1e-5, rtol=1e-5)
    assert torch.all(kept[~target.any(dim=0).expand_as(target)] == 0)


@pytest.mark.slow
def test_two_torchrun_ranks_match_one_process(
    tiny_llama: Path, chat_tasks: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    hyper = {**SFT_HYPER, "steps": 2, "batch_size": 4, "micro_batch": 2, "threads": 1}
    commands = {"single": job_command, "ddp": torchrun_job_command}
    for name, command in commands.items():
        spec = write_train_spec(
            tmp_path / name,
            algorithm="sft",
            dataset=chat_tasks["v1"],
            base_checkpoint=tiny_llama,
            hyperparameters=hyper,
        )
        run_job_process(command(spec), timeout=600)
    one = read_metrics(tmp_path / "single")
    two = read_metrics(tmp_path / "ddp")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["train_tokens"] == two["train_tokens"]
    a = load_file(str(tmp_path / "single" / "out" / "checkpoint" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "ddp" / "out" / "checkpoint" / "adapter_model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


def test_a_lora_trainers_rollouts_decode_its_adapter_folded_and_leave_the_weights_intact(
    sft_adapter: Path, chat_tasks: dict[str, Path]
) -> None:
    from services.environments import read_task_file
    from services.training.config import HFGRPOConfig
    from services.training.hf.family import HFFamily

    trainee = HFFamily().load(
        sft_adapter, device=torch.device("cpu"), training=HFGRPOConfig(**GRPO_HYPER)
    )
    module = trainee.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    probe = torch.tensor([[1, 5, 9, 17, 33, 64]])
    with torch.no_grad():
        logits_before = module(input_ids=probe).logits
    env = ToolcalcEnvironment()
    tasks = read_task_file(chat_tasks["v1"])[:3]
    options = {"seeds": [1, 2, 3], "max_turns": 2, "max_new_tokens": 8, "temperature": 1.0}

    folded = trainee.rollouts(env, tasks, **options)
    module.eval()
    with torch.no_grad():
        unfolded = trainee.chat.rollouts(env, tasks, **options)  # peft's own LoRA path
        with module.disable_adapter():
            base = trainee.chat.rollouts(env, tasks, **options)

    assert [e.turns for e in folded.episodes] == [e.turns for e in unfolded.episodes]
    for ours, theirs, plain in zip(folded.episodes, unfolded.episodes, base.episodes, strict=True):
        mine = torch.tensor([v for turn in ours.sampler_logprobs or [] for v in turn])
        peft = torch.tensor([v for turn in theirs.sampler_logprobs or [] for v in turn])
        torch.testing.assert_close(mine, peft, atol=1e-5, rtol=1e-5)
        assert ours.sampler_logprobs != plain.sampler_logprobs  # the adapter was applied
    after = dict(module.named_parameters())
    assert all(torch.equal(p, after[n].detach()) for n, p in before.items())
    with torch.no_grad():
        assert torch.equal(module(input_ids=probe).logits, logits_before)


@pytest.mark.parametrize(("dtype", "folds"), [(torch.float32, True), (torch.bfloat16, False)])
def test_only_fp32_weights_take_the_adapter_folded(
    sft_adapter: Path, dtype: torch.dtype, folds: bool
) -> None:
    """A bf16 base would round a LoRA update away in the sum: it keeps peft's path."""
    from services.training.config import HFGRPOConfig
    from services.training.hf.family import HFFamily, folded_adapter

    trainee = HFFamily().load(
        sft_adapter, device=torch.device("cpu"), training=HFGRPOConfig(**GRPO_HYPER)
    )
    module = trainee.module.to(dtype)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with folded_adapter(module):
        changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert bool(changed) is folds
    assert all(".base_layer." in n for n in changed)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
