"""The episode rules over a trace's stored rows: what is complete, what waits, what is late."""

from __future__ import annotations

from itertools import count

from services.ingest.episodes import AGENT, GENAI, LOG, OTHER, Node, plan_trace

_ids = count(1)


def node(
    span: str,
    parent: str = "",
    kind: str = GENAI,
    *,
    remote: bool | None = False,
    content: bool = True,
    assembled: bool = False,
) -> Node:
    return Node(
        next(_ids),
        span,
        span,
        parent,
        kind,
        remote if parent else None,
        content,
        assembled,
    )


def log(span: str, record: str, *, content: bool = True) -> Node:
    return Node(next(_ids), f"{span}:{record}", span, "", LOG, None, content, False)


def spans_of(plan_episode: object) -> list[str]:
    return sorted(n.span_id for n in plan_episode.spans)  # type: ignore[attr-defined]


def test_children_wait_until_their_local_root_arrives() -> None:
    chat = node("chat", "agent")
    tool = node("tool", "agent")
    assert plan_trace([chat, tool], flush=False).episodes == []
    agent = node("agent", "", AGENT)
    [episode] = plan_trace([chat, tool, agent], flush=False).episodes
    assert episode.agent == agent and spans_of(episode) == ["agent", "chat", "tool"]
    assert (episode.key_span_id, episode.key_is_root) == ("agent", True)


def test_an_agent_under_a_local_http_span_waits_for_it_then_leaves_it_as_context() -> None:
    agent = node("agent", "http", AGENT, remote=False)
    chat = node("chat", "agent")
    assert plan_trace([agent, chat], flush=False).episodes == []  # the parent is local: wait
    http = node("http", "gateway", OTHER, remote=True)
    plan = plan_trace([agent, chat, http], flush=False)
    [episode] = plan.episodes
    assert (episode.key_span_id, episode.key_is_root) == ("agent", False)
    assert [n.span_id for n in plan.context] == ["http"]


def test_two_agents_under_one_upstream_request_are_two_episodes() -> None:
    rows = [
        node("a1", "up", AGENT, remote=True),
        node("c1", "a1"),
        node("a2", "up", AGENT, remote=True),
        node("c2", "a2"),
    ]
    plan = plan_trace(rows, flush=False)
    assert sorted(e.key_span_id for e in plan.episodes) == ["a1", "a2"]


def test_without_remote_flags_an_agent_span_closes_its_episode() -> None:
    rows = [node("agent", "up", AGENT, remote=None), node("chat", "agent", remote=None)]
    [episode] = plan_trace(rows, flush=False).episodes
    assert episode.key_span_id == "agent"


def test_calls_without_an_agent_span_under_an_upstream_parent_wait_for_quiet() -> None:
    rows = [node("c1", "up", remote=True), node("c2", "up", remote=True)]
    assert plan_trace(rows, flush=False).episodes == []
    [episode] = plan_trace(rows, flush=True).episodes
    # One episode, known by the upstream span the calls share.
    assert (episode.agent, episode.key_span_id, episode.key_is_root) == (None, "up", False)
    assert spans_of(episode) == ["c1", "c2"]


def test_nested_agents_exported_together_are_one_episode() -> None:
    rows = [
        node("outer", "", AGENT),
        node("inner", "tool", AGENT),
        node("tool", "outer"),
        node("chat", "inner"),
    ]
    [episode] = plan_trace(rows, flush=False).episodes
    assert episode.key_span_id == "outer" and len(episode.spans) == 4


def test_spans_of_an_assembled_episode_are_late_and_repeats_are_ignored() -> None:
    agent = node("agent", "", AGENT, assembled=True)
    chat = node("chat", "agent", assembled=True)
    late = node("late", "chat")
    late_log = log("chat", "r1")
    plan = plan_trace([agent, chat, late, late_log], flush=False)
    assert plan.episodes == []
    assert sorted(n.record_id for n in plan.late) == ["chat:r1", "late"]


def test_a_tree_without_content_waits_for_its_log_records() -> None:
    agent = node("agent", "", AGENT, content=False)
    chat = node("chat", "agent", content=False)
    assert plan_trace([agent, chat], flush=False).episodes == []
    records = [log("chat", "user"), log("chat", "choice")]
    [episode] = plan_trace([agent, chat, *records], flush=False).episodes
    assert sorted(n.record_id for n in episode.logs) == ["chat:choice", "chat:user"]


def test_a_tree_without_genai_spans_is_unmapped_and_stray_logs_are_dropped_on_flush() -> None:
    http = node("http", "", OTHER)
    db = node("db", "http", OTHER)
    stray = log("elsewhere", "r")
    plan = plan_trace([http, db, stray], flush=False)
    assert [sorted(n.span_id for n in members) for members in plan.unmapped] == [["db", "http"]]
    assert plan.context == []  # the stray log waits for its span
    flushed = plan_trace([stray], flush=True)
    assert [n.record_id for n in flushed.context] == ["elsewhere:r"]


def test_a_parent_cycle_does_not_hang() -> None:
    rows = [node("a", "b"), node("b", "a")]
    assert plan_trace(rows, flush=False).episodes == []
    flushed = plan_trace(rows, flush=True)
    in_episodes = [n.record_id for episode in flushed.episodes for n in episode.rows]
    assert sorted(in_episodes) == ["a", "b"]  # each row in one episode, none lost


def test_a_long_chain_of_spans_is_planned_whole() -> None:
    """10,000 spans each the parent of the next (the most a single export may hold)."""
    chain = [node("s0", "", AGENT)] + [node(f"s{n}", f"s{n - 1}") for n in range(1, 10_000)]
    [episode] = plan_trace(chain[::-1], flush=False).episodes
    assert len(episode.spans) == 10_000
    done = [node("s0", "", AGENT, assembled=True), *chain[1:]]
    assert len(plan_trace(done, flush=False).late) == 9_999
