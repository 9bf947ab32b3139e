"""How a replay task's answer is scored, from the reward curation chose (:mod:`.rewards`).

- **A reference** (``verifier.params.reward.kind: reference``): the rule decides
  (:func:`.matching.score`); the reward is ``{"answer": credit}``, the credit being the
  fraction of the reference's facts stated under ``facts`` (partial credit below the pass)
  and 0 or 1 under the other rules.
- **A judge** (``kind: judge``): its verdict, ``{"judge": score}``, passed at ``pass``; the
  judge sees the task's reference when it has one.
- **Both**: where the loop names a judge, a reference task carries it too (``reward.judge``)
  and the rule still decides, the more trusted of the two. On a sample of tasks the judge is
  asked as well and the two verdicts are counted (:class:`.judge.JudgeAgreement`): the tasks
  whose id falls in the first :data:`AGREEMENT_SHARE` of the sha256 space (so champion and
  candidate are compared on the same tasks, whatever the order episodes end in), every
  episode of them, at most :data:`AGREEMENT_MAX_EPISODES` per judge and process. Only a
  process that asks for it samples (the eval job, which reports ``judge_agreement``); a
  judge that does not answer a sampled question is counted as an error, never a failed job:
  the rule has already scored the episode.

:func:`describe_reward` says what a stored reward checks, for the listings that show it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.environments.base import Reward, TaskSpec
from services.environments.replay import matching
from services.environments.replay.facts import Fact, FactsError
from services.environments.replay.judge import Judge, JudgeError, Verdict

AGREEMENT_SHARE = 0.25
AGREEMENT_MAX_EPISODES = 256


def reference_reward(task: TaskSpec, spec: Mapping[str, Any], answer: str | None) -> Reward:
    """The rule's score of ``answer`` against the task's reference."""
    reference = task.reference_answer
    if reference is None:
        raise ValueError(f"task {task.task_id[:12]} has a reference reward and no answer")
    try:
        raw = spec.get("match", matching.DEFAULT_RULE)
        rule = matching.parse_rule(raw, where="verifier.match", stored=True)
        found = matching.score(answer, reference, rule)
    except matching.MatchRuleError as exc:
        raise ValueError(f"task {task.task_id[:12]}: {exc}") from None
    return Reward(components={"answer": found.credit}, total=found.credit, passed=found.passed)


def judge_reward(
    judges: Mapping[str, Judge],
    task: TaskSpec,
    spec: Mapping[str, Any],
    answer: str | None,
    conversation: str,
) -> Reward:
    """The judge's verdict on ``answer``; a judge this process lacks or that does not answer
    is an error for the job, never a zero."""
    judge = judges.get(spec["endpoint"])
    if judge is None:
        raise ValueError(
            f"task {task.task_id[:12]} is scored by judge endpoint {spec['endpoint']!r}, "
            "which this process was not given (settings.judge_endpoints)"
        )
    try:
        verdict = _ask(judge, task, spec, answer, conversation)
    except JudgeError as exc:
        raise ValueError(f"task {task.task_id[:12]}: {exc}") from None
    return Reward(components={"judge": verdict.score}, total=verdict.score, passed=verdict.passed)


def compare_with_judge(
    judges: Mapping[str, Judge],
    task: TaskSpec,
    spec: Any,
    answer: str | None,
    conversation: str,
    *,
    rule_passed: bool,
) -> None:
    """On the sample (see the module docstring), ask the task's judge too and count whether
    it agrees with the rule's verdict."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("endpoint"), str):
        return
    judge = judges.get(spec["endpoint"])
    if judge is None or not judge.agreement.sampling or not in_agreement_sample(task.task_id):
        return
    record = judge.agreement
    if record.episodes + record.errors >= AGREEMENT_MAX_EPISODES:
        return
    try:
        verdict: Verdict | None = _ask(judge, task, spec, answer, conversation)
    except JudgeError:
        verdict = None
    judge.record_agreement(rule_passed, verdict)


def in_agreement_sample(task_id: str) -> bool:
    """Whether the task is one whose episodes the judge is also asked about."""
    digest = hashlib.sha256(f"judge-agreement:{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < AGREEMENT_SHARE * 2**32


def _ask(
    judge: Judge,
    task: TaskSpec,
    spec: Mapping[str, Any],
    answer: str | None,
    conversation: str,
) -> Verdict:
    return judge.verdict(
        task_id=task.task_id,
        conversation=conversation,
        answer=answer,
        rubric=str(spec.get("rubric") or ""),
        model=str(spec.get("model") or "judge"),
        cost_per_1k_tokens=float(spec.get("cost_per_1k_tokens") or 0.0),
        reference=task.reference_answer,
    )


@dataclass(frozen=True)
class RewardCheck:
    """What a replay task's reward checks, as the listings show it: the rule (``facts``,
    ``text``, ``number``, ``json_subset``, ``regex``, or ``judge`` when a judge decides),
    the facts it looks for, and the judge endpoint (deciding, or compared on a sample)."""

    rule: str
    facts: tuple[Fact, ...] = ()
    judge: str | None = None


def describe_reward(reward: Any) -> RewardCheck | None:
    """The check a stored ``verifier.params.reward`` makes, or None for anything else (a
    task of another environment); facts that do not parse are left out, not raised: this
    only shows what is stored."""
    if not isinstance(reward, Mapping) or reward.get("kind") not in ("reference", "judge"):
        return None
    if reward["kind"] == "judge":
        endpoint = reward.get("endpoint")
        return RewardCheck("judge", judge=endpoint if isinstance(endpoint, str) else None)
    match = reward.get("match")
    match = match if isinstance(match, Mapping) else {}
    facts: list[Fact] = []
    raw_facts = match.get("facts")
    for index, raw in enumerate(raw_facts if isinstance(raw_facts, list) else []):
        try:
            facts.append(Fact.from_dict(raw, where=f"facts[{index}]"))
        except FactsError:
            continue
    judge = reward.get("judge")
    endpoint = judge.get("endpoint") if isinstance(judge, Mapping) else None
    return RewardCheck(
        rule=str(match.get("rule") or matching.DEFAULT_RULE),
        facts=tuple(facts),
        judge=endpoint if isinstance(endpoint, str) else None,
    )


def task_reward(spec: Any) -> Any:
    """``verifier.params.reward`` of a stored task (``ratchet.task/v1`` object), or None."""
    if not isinstance(spec, Mapping):
        return None
    verifier = spec.get("verifier")
    params = verifier.get("params") if isinstance(verifier, Mapping) else None
    return params.get("reward") if isinstance(params, Mapping) else None
