"""toolcalc: APIs, tasks, rollout step, rubric verifier."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.environments import Environment, TaskSpec, get_environment
from services.environments.toolcalc import (
    TOOLCALC_API_VERSIONS,
    ToolcalcEnvironment,
    UnverifiableRequest,
    get_api,
    solve,
)
from services.environments.toolcalc.api import ParsedCall, deprecation_window


@pytest.fixture
def env() -> ToolcalcEnvironment:
    return ToolcalcEnvironment()


def scripted(*turns: str) -> Callable[[str], str]:
    """An ``act`` that replays fixed turns and records the transcripts it saw."""
    remaining = list(turns)

    def act(transcript: str) -> str:
        act.seen.append(transcript)  # type: ignore[attr-defined]
        return remaining.pop(0)

    act.seen = []  # type: ignore[attr-defined]
    return act


def test_registry_and_protocol() -> None:
    env = get_environment("toolcalc")
    assert isinstance(env, Environment)
    assert env.name == "toolcalc"
    with pytest.raises(ValueError, match=r"unknown environment 'nope'.*toolcalc"):
        get_environment("nope")


def test_api_versions_drift() -> None:
    assert TOOLCALC_API_VERSIONS == ("v1", "v2", "v3")
    v1, v2, v3 = (get_api(v) for v in TOOLCALC_API_VERSIONS)
    assert v1.listing() == "tools: #add(a,b) &mul(a,b) @get(item)"
    assert v2.listing() == "tools: #plus(a,b) &times(a,b) @price(item)"  # renamed
    assert v3.listing() == "tools: #plus(a;b) &times(a;b) @price(item;cur)"  # syntax + new arg
    assert v3.tool_specs()[2]["parameters"]["required"] == ["item", "cur"]
    with pytest.raises(ValueError, match="unknown toolcalc API version 'v9'"):
        get_api("v9")


@pytest.mark.parametrize(
    ("version", "text", "ok"),
    [
        ("v1", "mul(12,37)", True),
        ("v1", "times(12,37)", True),  # v1 accepts the announced v2 names as aliases
        ("v1", "&mul(12,37)", True),
        ("v1", "@mul(12,37)", False),  # wrong sigil
        ("v2", "mul(12,37)", False),  # the old name after the rename
        ("v2", "times(12,37)", True),
        ("v3", "times(12,37)", False),  # old separator
        ("v3", "times(12;37)", True),
        ("v3", "price(pear)", False),  # missing the new required argument
        ("v3", "price(pear;usd)", True),
        ("v1", "mul(12)", False),
        ("v1", "mul(a,37)", False),
        ("v1", "get(Pear)", False),
    ],
)
def test_call_syntax_per_version(version: str, text: str, ok: bool) -> None:
    parsed = get_api(version).parse_call(text)
    assert parsed is not None
    assert isinstance(parsed, ParsedCall) is ok


def test_solve_recomputes_program() -> None:
    program = solve("$pear*37", get_api("v1"))
    assert program.calls == (("lookup", ("pear",)), ("mul", (12, 37)))
    assert program.answer == 444
    assert solve("$fig+$kiwi", get_api("v3")).calls == (
        ("lookup", ("fig", "usd")),
        ("lookup", ("kiwi", "usd")),
        ("add", (7, 9)),
    )
    for request, reason in [
        ("hello", "unverifiable_request"),
        ("42", "no_tool_needed"),
        ("$durian*2", "unknown_item"),
    ]:
        with pytest.raises(UnverifiableRequest) as info:
            solve(request, get_api("v1"))
        assert info.value.reason == reason


def test_generate_tasks_deterministic_and_distinct(env: ToolcalcEnvironment) -> None:
    first = env.generate_tasks(50, seed=7, api_version="v2")
    again = env.generate_tasks(50, seed=7, api_version="v2")
    other = env.generate_tasks(50, seed=8, api_version="v2")
    assert [t.task_id for t in first] == [t.task_id for t in again]
    assert len({t.task_id for t in first}) == 50
    assert [t.task_id for t in first] != [t.task_id for t in other]
    task = first[0]
    assert task.prompt.startswith("tools: #plus(a,b) &times(a,b) @price(item)\nuser: ")
    assert task.metadata == {"environment": "toolcalc", "api_version": "v2"}
    assert task.reference_answer == str(
        solve(task.verifier["params"]["request"], get_api("v2")).answer
    )


def _task(env: ToolcalcEnvironment, request: str, version: str) -> TaskSpec:
    return env.make_task(request, version)


def test_episode_and_full_rubric(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$pear*37", "v1")
    act = scripted("get(pear)", "mul(12,37)", "ans 444")
    episode = env.run_episode(task, act, max_turns=5)
    assert act.seen[0] == task.prompt + "> "  # type: ignore[attr-defined]
    assert act.seen[2].endswith("> get(pear)\n= 12\n> mul(12,37)\n= 444\n> ")  # type: ignore[attr-defined]
    assert episode.done and episode.end_reason == "answered"
    reward = env.verify(task, episode)
    assert reward.components == {"syntax": 1.0, "tools": 1.0, "answer": 1.0}
    assert reward.total == 1.0 and reward.passed


def test_rubric_wrong_answer_right_tools(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$pear*37", "v1")
    episode = env.run_episode(task, scripted("get(pear)", "mul(12,37)", "ans 443"), max_turns=5)
    reward = env.verify(task, episode)
    assert reward.components == {"syntax": 1.0, "tools": 1.0, "answer": 0.0}
    assert reward.total == pytest.approx(0.3) and not reward.passed


def test_rubric_old_api_after_drift(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$pear*37", "v2")
    episode = env.run_episode(task, scripted("get(pear)", "mul(12,37)", "ans 444"), max_turns=5)
    assert [t.text for t in episode.turns if t.role == "env"] == [
        "error: unknown tool get",
        "error: unknown tool mul",
    ]
    reward = env.verify(task, episode)
    # guessing the right number passes (the pass criterion is the answer), but the rubric
    # shows no valid call and no right tool
    assert reward.components == {"syntax": 0.0, "tools": 0.0, "answer": 1.0}
    assert reward.total == pytest.approx(0.7)


def test_rubric_partial_tools_and_syntax(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$fig+$kiwi", "v3")
    episode = env.run_episode(
        task,
        scripted("price(fig;usd)", "price(kiwi)", "plus(7,9)", "plus(7;9)", "ans 16"),
        max_turns=5,
    )
    reward = env.verify(task, episode)
    # 2 of 4 calls well-formed; the program's calls: price(fig;usd) made, price(kiwi;usd) not,
    # plus(7;9) made -> 2/3
    assert reward.components["syntax"] == pytest.approx(0.5)
    assert reward.components["tools"] == pytest.approx(2 / 3)
    assert reward.passed


def test_malformed_turns_and_max_turns(env: ToolcalcEnvironment) -> None:
    task = _task(env, "12+34", "v1")
    episode = env.run_episode(task, scripted("let me think", "add(12,34", "ans forty"), max_turns=3)
    replies = [t.text for t in episode.turns if t.role == "env"]
    assert replies == ["error: expected name(args) or ans <number>"] * 2
    assert episode.end_reason == "answered"
    reward = env.verify(task, episode)
    assert reward.components == {"syntax": 0.0, "tools": 0.0, "answer": 0.0}
    assert not reward.passed

    looping = env.run_episode(task, scripted(*["add(1,2)"] * 5), max_turns=2)
    assert looping.done and looping.end_reason == "max_turns"
    assert len(looping.agent_turns) == 2
    assert env.verify(task, looping).components["syntax"] == 1.0


def test_bad_item_and_currency_are_tool_errors(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$fig*3", "v3")
    episode = env.run_episode(
        task, scripted("price(durian;usd)", "price(fig;gbp)", "ans 21"), max_turns=5
    )
    assert [t.text for t in episode.turns if t.role == "env"] == [
        "error: unknown item durian",
        "error: unknown currency gbp",
    ]


def test_verify_rejects_foreign_task(env: ToolcalcEnvironment) -> None:
    task = _task(env, "1+2", "v1")
    foreign = TaskSpec.create(
        environment="other", prompt="p", tools=[], verifier={"reward_id": "x", "params": {}}
    )
    episode = env.start(task, max_turns=1)
    with pytest.raises(ValueError, match="belongs to 'other'"):
        env.verify(foreign, episode)


def test_demonstrations_solve_their_tasks(env: ToolcalcEnvironment) -> None:
    for version in TOOLCALC_API_VERSIONS:
        tasks = env.generate_tasks(30, seed=3, api_version=version)
        for task, episode in zip(tasks, env.demonstrations(tasks, seed=0), strict=True):
            assert env.verify(task, episode).total == 1.0


def test_deprecation_window_demonstrations(env: ToolcalcEnvironment) -> None:
    tasks = env.generate_tasks(40, seed=3, api_version="v1")
    window = env.demonstrations(tasks, seed=0, augment_fraction=1.0)
    assert window == env.demonstrations(tasks, seed=0, augment_fraction=1.0)  # deterministic
    migrated = 0
    for task, episode in zip(tasks, window, strict=True):
        assert episode.prompt.startswith("tools: #plus(a,b) &times(a,b) @price(item)\n")
        names = {t.text.split("(")[0] for t in episode.agent_turns if t.answer is None}
        assert names <= {"#add", "&mul", "@get"} or names <= {"#plus", "&times", "@price"}
        migrated += names <= {"#plus", "&times", "@price"}
        assert env.verify(task, episode).total == 1.0  # both names worked in the window
    assert 3 <= migrated <= 20  # MIGRATED_SHARE = 0.25 of 40
    # the window accepts the old names; v2 proper does not
    assert isinstance(deprecation_window("v1", "v2").parse_call("@get(pear)"), ParsedCall)
    v2_task = env.make_task("$pear*3", "v2")
    episode = env.run_episode(v2_task, scripted("@get(pear)", "ans 36"), max_turns=3)
    assert episode.turns[1].text == "error: unknown tool get"


def test_trace_messages_shape(env: ToolcalcEnvironment) -> None:
    task = _task(env, "$pear*37", "v2")
    episode = env.run_episode(task, scripted("price(pear)", "times(12,37)", "ans 444"), max_turns=5)
    messages = episode.to_trace_messages()
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[1] == {"role": "user", "content": "$pear*37"}
    assert messages[2]["tool_calls"] == [
        {"id": "call_1", "name": "price", "arguments": {"item": "pear"}}
    ]
    assert messages[3] == {
        "role": "tool",
        "content": "12",
        "tool_call_id": "call_1",
        "name": "price",
    }
    assert messages[-1] == {"role": "assistant", "content": "444"}
