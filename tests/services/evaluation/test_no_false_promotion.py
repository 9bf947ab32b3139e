"""No false promotions, from real evaluator output: the gate on sampled pass@1.

- A candidate identical to the champion (the same weights, loaded twice) is never promoted
  and gains exactly 0 held-out points, over many seeds: both are evaluated with the same
  seed (common random numbers), so every sample agrees and no task is discordant.
- A candidate that breaks v1 is rejected by the regression suite even with a large win on
  the eval set.

The evaluations are real (rollouts in toolcalc, verified); a policy that passes only part of
the time makes the pass@1 estimates non-trivial: it replays a task's demonstration on some
sampling seeds and lets its tiny GPT answer on the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.evaluator import EvaluationResult, EvaluationSettings, evaluate
from services.evaluation.gate import decide
from services.evaluation.results import pass_at_1
from services.evaluation.stats import compare_paired
from services.loop.policies import GatePolicy
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig, TinyModel

TINY = GPTConfig(max_seq_len=160, n_layer=1, n_head=2, d_model=16)
ENV = ToolcalcEnvironment()
POLICY = GatePolicy(confidence=0.95, regression_tolerance_points=2.0, min_discordant_pairs=5)


class SometimesSolves(TinyModel):
    """Replays the demonstration's turn when the turn's ``seed % 3 != 0`` (and, if ``only``
    is set, only for tasks of that API version); otherwise the GPT's own sampled turn."""

    def __init__(self, model: GPT, tasks: Sequence[TaskSpec], *, only: str | None = None):
        super().__init__(model)
        self._demos = {t.prompt: ENV.demonstration(t) for t in tasks}
        self._versions = {t.prompt: t.metadata.get("api_version") for t in tasks}
        self._only = only

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | Sequence[int] = 0,
    ) -> list[str]:
        seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
        replayed = [self._replay(p, s) for p, s in zip(prompts, seeds, strict=True)]
        own_rows = [i for i, text in enumerate(replayed) if text is None]
        own = super().generate(
            [prompts[i] for i in own_rows],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=[seeds[i] for i in own_rows],
        )
        for i, text in zip(own_rows, own, strict=True):
            replayed[i] = text
        return [text or "" for text in replayed]

    def _replay(self, prompt: str, seed: int) -> str | None:
        task_prompt = next((p for p in self._demos if prompt.startswith(p)), None)
        if task_prompt is None or seed % 3 == 0:
            return None
        if self._only is not None and self._versions[task_prompt] != self._only:
            return None
        turns = self._demos[task_prompt].agent_turns
        turn = prompt.count("\n> ") - 1
        return turns[turn].text if turn < len(turns) else None


def scores(result: EvaluationResult) -> list[float]:
    return [pass_at_1(r.to_dict()) for r in result.results]


def run(policy: TinyModel, tasks: Sequence[TaskSpec], seed: int) -> list[float]:
    settings = EvaluationSettings(
        samples=4, temperature=1.0, seed=seed, max_turns=3, max_new_tokens=8
    )
    result = evaluate(policy, ENV, tasks, settings)
    return scores(result)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("same") / "ckpt"
    save_checkpoint(GPT(TINY), TINY, directory)
    return directory


@pytest.mark.slow
def test_a_candidate_identical_to_the_champion_is_never_promoted(checkpoint: Path) -> None:
    eval_tasks = ENV.generate_tasks(8, seed=3, api_version="v2")
    regression_tasks = ENV.generate_tasks(4, seed=4, api_version="v1")
    heldout_tasks = ENV.generate_tasks(6, seed=5, api_version="v1")
    heldout_tasks += ENV.generate_tasks(6, seed=6, api_version="v2")
    every_task = eval_tasks + regression_tasks + heldout_tasks
    # Two loads of one checkpoint: the same weights, two model objects, as in two eval jobs.
    champion = SometimesSolves(TinyModel.load(checkpoint, device="cpu").model, every_task)
    candidate = SometimesSolves(TinyModel.load(checkpoint, device="cpu").model, every_task)
    nontrivial = 0
    for seed in range(8):
        eval_champion, eval_candidate = (run(p, eval_tasks, seed) for p in (champion, candidate))
        regression = [run(p, regression_tasks, seed) for p in (champion, candidate)]
        heldout = [run(p, heldout_tasks, seed) for p in (champion, candidate)]
        decision = decide(eval_champion, eval_candidate, *regression, POLICY, seed=seed)
        assert decision.decision == "reject", (seed, decision.reason)
        assert decision.statistics["eval"]["discordant"] == 0
        points = compare_paired(*heldout, seed=seed)
        assert points.delta_points == 0.0 and points.discordant == 0
        assert (points.ci_low, points.ci_high) == (0.0, 0.0)
        nontrivial += 0.0 < sum(heldout[0]) / len(heldout[0]) < 1.0
    # The pass@1 estimates were strictly between 0 and 1: the samples really differed.
    assert nontrivial == 8


def test_a_candidate_that_breaks_v1_is_rejected_by_the_regression_suite() -> None:
    torch.manual_seed(1)
    model = GPT(TINY)
    eval_tasks = ENV.generate_tasks(12, seed=7, api_version="v2")
    regression_tasks = ENV.generate_tasks(8, seed=8, api_version="v1")
    # The champion solves v1 (its regression suite) but not v2; the candidate learnt v2 and
    # forgot v1.
    champion = SometimesSolves(model, eval_tasks + regression_tasks, only="v1")
    candidate = SometimesSolves(model, eval_tasks + regression_tasks, only="v2")
    eval_champion, eval_candidate = (run(p, eval_tasks, 0) for p in (champion, candidate))
    regression = [run(p, regression_tasks, 0) for p in (champion, candidate)]
    # On the eval set alone the candidate wins by far ...
    alone = decide(eval_champion, eval_candidate, [], [], POLICY)
    assert alone.decision == "promote", alone.reason
    assert alone.statistics["delta_points"] > 30
    # ... and the regression suite refuses it.
    decision = decide(eval_champion, eval_candidate, *regression, POLICY)
    assert decision.decision == "reject"
    assert decision.reason.startswith("regression suite dropped"), decision.reason
    assert decision.statistics["regression"]["delta_points"] < -30


def test_too_few_discordant_tasks_never_promote() -> None:
    """Five tasks all won at a loose confidence still need the policy's discordant pairs."""
    loose = GatePolicy(confidence=0.8, min_discordant_pairs=6)
    decision = decide([0.0] * 5 + [1.0] * 5, [1.0] * 10, [], [], loose)
    assert decision.decision == "reject"
    assert "only 5 eval tasks tell the models apart" in decision.reason
    assert decide([0.0] * 6 + [1.0] * 4, [1.0] * 10, [], [], loose).decision == "promote"


def test_pass_at_1_is_estimated_from_the_samples() -> None:
    assert pass_at_1({"passed": True, "samples": 4, "sample_passes": 1}) == 0.25
    assert pass_at_1({"passed": False, "samples": 4, "sample_passes": 3}) == 0.75
    assert pass_at_1({"passed": True}) == 1.0
    # A malformed count falls back to the task's pass/fail, never to a rate outside [0, 1].
    assert pass_at_1({"passed": False, "samples": 2, "sample_passes": 5}) == 0.0
    assert pass_at_1({"passed": True, "samples": True, "sample_passes": 1}) == 1.0
