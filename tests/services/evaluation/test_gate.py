"""The gate promotes only on a significant paired win with no regression beyond tolerance."""

from __future__ import annotations

import pytest

from services.evaluation.gate import decide
from services.loop.policies import GatePolicy


def pairs(
    both: int, only_champion: int, only_candidate: int, neither: int
) -> tuple[list[bool], list[bool]]:
    champion = [True] * both + [True] * only_champion + [False] * only_candidate + [False] * neither
    candidate = (
        [True] * both + [False] * only_champion + [True] * only_candidate + [False] * neither
    )
    return champion, candidate


POLICY = GatePolicy(confidence=0.95, regression_tolerance_points=2.0, min_discordant_pairs=0)


def test_significant_win_promotes() -> None:
    champion, candidate = pairs(both=10, only_champion=1, only_candidate=20, neither=9)
    decision = decide(champion, candidate, [], [], POLICY)
    assert decision.decision == "promote"
    assert decision.statistics["delta_points"] == pytest.approx(100 * 19 / 40)
    assert decision.statistics["eval"]["only_candidate"] == 20


def test_small_win_is_not_significant() -> None:
    # 3 improvements vs 1 regression: one-sided exact p = 5/16 > 0.05.
    champion, candidate = pairs(both=30, only_champion=1, only_candidate=3, neither=6)
    decision = decide(champion, candidate, [], [], POLICY)
    assert decision.decision == "reject"
    assert "no significant win" in decision.reason


def test_worse_candidate_is_rejected() -> None:
    champion, candidate = pairs(both=5, only_champion=20, only_candidate=0, neither=5)
    assert decide(champion, candidate, [], [], POLICY).decision == "reject"


def test_regression_beyond_tolerance_blocks_a_win() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=20, neither=10)
    reg_champion, reg_candidate = pairs(both=45, only_champion=5, only_candidate=0, neither=0)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.decision == "reject"
    assert "regression suite dropped 10.0 points" in decision.reason


def test_regression_within_tolerance_allows_a_win() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=20, neither=10)
    reg_champion, reg_candidate = pairs(both=99, only_champion=1, only_candidate=0, neither=0)
    assert decide(champion, candidate, reg_champion, reg_candidate, POLICY).decision == "promote"


def test_minimum_improvement() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=12, neither=78)
    policy = GatePolicy(confidence=0.95, min_improvement_points=20, min_discordant_pairs=0)
    decision = decide(champion, candidate, [], [], policy)
    assert decision.decision == "reject"
    assert "below the minimum" in decision.reason


def test_no_results_is_a_rejection() -> None:
    assert decide([], [], [], [], POLICY).decision == "reject"


@pytest.mark.parametrize("confidence", [0.3, 1.0])
def test_bad_policy(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence"):
        GatePolicy(confidence=confidence)


def test_judge_only_tasks_are_named_in_the_report() -> None:
    from services.evaluation.gate import judge_only_count

    champion, candidate = pairs(both=10, only_champion=1, only_candidate=20, neither=9)
    specs = [{"metadata": {"verifier_kind": "judge"}}] * 3 + [{"metadata": {}}, {}]
    decision = decide(champion, candidate, [], [], POLICY, judge_only_tasks=judge_only_count(specs))
    assert decision.decision == "promote"
    assert decision.reason.endswith("; 3 of 40 eval tasks are scored by an LLM judge only")
    assert decision.statistics["judge_only_tasks"] == 3
    plain = decide(champion, candidate, [], [], POLICY)
    assert "judge" not in plain.reason and "judge_only_tasks" not in plain.statistics


def test_a_drop_the_suite_cannot_show_is_named_but_does_not_refuse_a_win() -> None:
    """Seed 0's foreign-agent cycle: +32.5 points on 40 eval tasks, one of 7 suite tasks lost."""
    champion, candidate = pairs(both=12, only_champion=3, only_candidate=16, neither=9)
    reg_champion, reg_candidate = pairs(both=5, only_champion=1, only_candidate=0, neither=1)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.decision == "promote", decision.reason
    assert decision.statistics["regression_check"] == "loss_not_significant"
    assert decision.statistics["regression"]["p_value_loss"] == 0.5
    assert "the regression suite dropped 14.3 points" in decision.reason
    assert "1 worse / 0 better of 7 tasks" in decision.reason
    assert "it takes 5 tasks lost and none gained to show one at 95%" in decision.reason
    assert "ratchet tasks pin" in decision.reason


def test_a_suite_smaller_than_any_significant_loss_says_so() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=20, neither=10)
    reg_champion, reg_candidate = pairs(both=0, only_champion=4, only_candidate=0, neither=0)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.decision == "promote", decision.reason
    assert "a suite of 4 tasks cannot show a loss at 95%" in decision.reason


def test_a_significant_loss_beyond_tolerance_refuses_even_a_small_suite() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=20, neither=10)
    reg_champion, reg_candidate = pairs(both=2, only_champion=6, only_candidate=0, neither=0)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.decision == "reject"
    assert decision.statistics["regression_check"] == "significant_loss"
    assert decision.reason.startswith("regression suite dropped 75.0 points (tolerance 2;")
    assert "6 worse / 0 better of 8 tasks, one-sided p=0.0156" in decision.reason


def test_a_significant_loss_within_tolerance_does_not_refuse() -> None:
    champion, candidate = pairs(both=10, only_champion=0, only_candidate=20, neither=10)
    reg_champion, reg_candidate = pairs(both=394, only_champion=6, only_candidate=0, neither=0)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.statistics["regression"]["p_value_loss"] < 0.05
    assert decision.statistics["regression_check"] == "within_tolerance"
    assert decision.decision == "promote"
    assert "regression" not in decision.reason


def test_a_drop_that_is_not_significant_does_not_turn_a_refusal_into_a_promotion() -> None:
    champion, candidate = pairs(both=30, only_champion=1, only_candidate=3, neither=6)
    reg_champion, reg_candidate = pairs(both=5, only_champion=1, only_candidate=0, neither=1)
    decision = decide(champion, candidate, reg_champion, reg_candidate, POLICY)
    assert decision.decision == "reject"
    assert decision.reason.startswith("no significant win")
    assert "not a significant loss" in decision.reason


@pytest.mark.parametrize(
    ("confidence", "losses"), [(0.5, 2), (0.75, 3), (0.9, 4), (0.95, 5), (0.99, 7)]
)
def test_losses_to_show_is_the_fewest_clean_losses_below_alpha(
    confidence: float, losses: int
) -> None:
    from services.evaluation.gate import losses_to_show

    assert losses_to_show(confidence) == losses
    assert 0.5**losses < 1 - confidence <= 0.5 ** (losses - 1)
