"""Training passes that compute a shared prefix once: the same log-probs and gradients as the
plain pass, on a tiny random Llama with a LoRA adapter, and the grouping rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.training.config import HFSFTConfig
from services.training.family import PackedBatch, collate
from services.training.hf import shared_prefix
from services.training.hf.family import HFFamily, HFFamilyModel
from services.training.hf.shared_prefix import prefix_groups, shared_prefix_logprobs
from tests.services.training.hf_support import build_tiny_llama

SYSTEM = list(range(10, 50))  # 40 tokens every row starts with (the system text and tools)


def _rows() -> list[tuple[list[int], list[bool]]]:
    """Five sequences: three share SYSTEM and a user turn, one only SYSTEM, one nothing;
    targets (the assistant's tokens) after each row's prompt."""
    user_a, user_b = [60, 61, 62], [70, 71]
    specs = [
        (SYSTEM + user_a, [100, 101, 102, 103]),
        (SYSTEM + user_a, [104, 105]),
        (SYSTEM + user_a + [63], [106, 107, 108, 109, 110, 111]),
        (SYSTEM + user_b, [112, 113, 114]),
        (list(range(200, 230)), [115, 116, 117]),
    ]
    return [(p + c, [False] * len(p) + [True] * len(c)) for p, c in specs]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "model"
    build_tiny_llama(path)
    return path


@pytest.fixture
def lora_model(tiny_llama: Path) -> HFFamilyModel:
    torch.manual_seed(0)
    model = HFFamily().load(
        tiny_llama, device=torch.device("cpu"), training=HFSFTConfig(lora_r=4, lora_alpha=8)
    )
    for name, param in model.module.named_parameters():  # a LoRA B of zeros has no effect
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    model.train()
    return model


def _loss_and_grads(
    model: HFFamilyModel, batch: PackedBatch
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [p for _, p in model.trainable_parameters()]
    for param in params:
        param.grad = None
    logp = model.logprobs(batch)  # (N, T-1)
    loss = -(logp * batch.target).sum() / batch.target.sum()
    loss.backward()
    return logp.detach(), [p.grad.clone() for p in params if p.grad is not None]


def test_shared_prefix_gives_the_plain_log_probs_and_gradients(
    lora_model: HFFamilyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = collate(_rows(), pad_id=lora_model.pad_id, device=torch.device("cpu"))
    calls: list[int] = []
    real = shared_prefix._score_after_prefix

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(shared_prefix, "_score_after_prefix", counted)
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 8)
    shared_logp, shared_grads = _loss_and_grads(lora_model, batch)
    assert calls, "the shared-prefix pass did not run"
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 10**9)
    plain_logp, plain_grads = _loss_and_grads(lora_model, batch)

    torch.testing.assert_close(shared_logp[batch.target], plain_logp[batch.target])
    untrained = ~batch.target.any(dim=0)  # (T-1,) positions no row trains on
    assert torch.all(shared_logp[:, untrained] == 0)
    assert len(shared_grads) == len(plain_grads) > 0
    for shared, plain in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(shared, plain, atol=1e-6, rtol=1e-4)


def test_rows_group_by_their_longest_common_prefix_up_to_their_first_target() -> None:
    rows = _rows()
    batch = collate(rows, pad_id=0, device=torch.device("cpu"))
    lengths = [len(ids) for ids, _ in rows]
    limits = [mask.index(True) for _, mask in rows]
    groups = prefix_groups(batch.ids, lengths, limits, min_shared=8)
    by_rows = {tuple(sorted(g.rows)): g.shared for g in groups}
    # rows 0-2 share SYSTEM + user_a (43 tokens; row 2's extra token is its own) and row 3
    # SYSTEM (40): one run of four skips 3 x 40 tokens, more than 2 x 43; row 4 is alone
    assert by_rows == {(0, 1, 2, 3): 40, (4,): 0}
    tight = prefix_groups(batch.ids, lengths, limits, min_shared=41)
    assert {tuple(sorted(g.rows)): g.shared for g in tight} == {(0, 1, 2): 43, (3,): 0, (4,): 0}
    # a row's first target bounds what it may share: the output head is applied there
    early = prefix_groups(batch.ids, lengths, [5, 5, 5, 5, 5], min_shared=4)
    assert {tuple(sorted(g.rows)): g.shared for g in early} == {(0, 1, 2, 3): 5, (4,): 0}


def test_rows_whose_tool_lists_differ_midway_share_more_as_two_runs() -> None:
    """Demonstrations from before and after a tool changed: all four share the system text
    (8 tokens), each pair its whole tool list (40): two runs of two skip 2 x 40 tokens, one
    run of four only 3 x 8."""
    before, after = list(range(10, 50)), [*range(10, 18), *range(300, 332)]
    prompts = [[*before, 60], [*before, 61], [*after, 62], [*after, 63]]
    rows = [([*p, 100, 101], [False] * len(p) + [True] * 2) for p in prompts]
    batch = collate(rows, pad_id=0, device=torch.device("cpu"))
    lengths = [len(ids) for ids, _ in rows]
    limits = [mask.index(True) for _, mask in rows]
    groups = prefix_groups(batch.ids, lengths, limits, min_shared=4)
    assert {tuple(sorted(g.rows)): g.shared for g in groups} == {(0, 1): 40, (2, 3): 40}


def test_no_shared_prefix_and_dropout_fall_back_to_the_plain_pass(
    tiny_llama: Path,
) -> None:
    rows = _rows()
    batch = collate(rows[3:], pad_id=0, device=torch.device("cpu"))
    model = HFFamily().load(
        tiny_llama, device=torch.device("cpu"), training=HFSFTConfig(lora_r=4, lora_alpha=8)
    )
    # two rows with nothing in common: nothing to share
    assert shared_prefix_logprobs(model.module, batch.ids, batch.attention, batch.target) is None
    # LoRA dropout in training mode would draw one mask for the shared rows: not shared
    dropping = HFFamily().load(
        tiny_llama,
        device=torch.device("cpu"),
        training=HFSFTConfig(lora_r=4, lora_alpha=8, lora_dropout=0.1),
    )
    dropping.train()
    full = collate(rows, pad_id=0, device=torch.device("cpu"))
    assert shared_prefix_logprobs(dropping.module, full.ids, full.attention, full.target) is None
    dropping.train(False)
    assert (
        shared_prefix_logprobs(dropping.module, full.ids, full.attention, full.target) is not None
    )
