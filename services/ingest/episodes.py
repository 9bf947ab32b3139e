"""Which OTLP spans make one episode, and when an episode is complete: pure rules.

Exporters do not send an episode in one piece. A ``SimpleSpanProcessor`` exports every span
alone, children before their parent; a ``BatchSpanProcessor`` cuts a long episode across
batches; a Collector's batch processor splits and merges exports; and the agent often runs
inside a request whose root span lives upstream (a gateway's ``traceparent``), so the trace's
root never reaches Ratchet at all. So spans wait (durably, see services.ingest.span_store),
and these rules, run over everything stored for a trace, say what can be assembled now:

- **Episode.** The outermost ``invoke_agent`` span and its descendants. A tree without one
  is one episode: its GenAI spans (any ``gen_ai.*`` attribute), known by the tree's top (or,
  when the top's parent never arrived, by that parent, so sibling calls under one upstream
  span stay together). Spans outside every episode (an HTTP server span around the agent,
  say) are context: kept for the structure, never stored as traces.
- **Tree.** Waiting spans are linked by parent id; the top of a tree is a span whose parent
  has not arrived. A tree is complete when its top is the trace's root (no parent); or a local
  root holding an agent span: its parent flagged remote by the exporter (OTLP span flags: the
  agent runs under an upstream ``traceparent``), or, when the exporter does not say (older
  SDKs, hand-written OTLP/JSON), an ``invoke_agent`` top whose parent has not arrived. A
  local root ends after its descendants, and span processors export spans in the order they
  end, so when it arrives its process's part of the tree is there. Without an agent span,
  calls under an upstream parent wait for the quiet period: more of them may follow.
- **Content.** A complete tree whose spans carry no messages (``gen_ai.input.messages`` /
  ``gen_ai.output.messages``) and no content log records yet waits anyway: the content may
  come as log records, which are exported on their own schedule.
- **Quiet period.** A trace that received nothing for ``RATCHET_OTLP_EPISODE_QUIET_S`` is
  flushed: every waiting tree counts as complete (a crashed process never sends its root).
  So is a trace that never goes quiet, ``RATCHET_OTLP_EPISODE_MAX_WAIT_S`` after its first
  waiting span (a session that reuses one trace id for hours).
- **Late and repeated spans.** Assembled spans keep their ids for a retention period; a span
  that descends from one, or a log record of one, arrived after its episode was stored and
  is dropped (reported), so it never becomes a second, partial trace. The same span exported
  twice is stored once.

A trace may hold several episodes (two agents under one upstream request); an episode is
identified by its span, which is what makes its external id stable however it was exported.
Nested agents in one process become one episode when their spans reach Ratchet together or
the outer agent's span arrives first; under a ``SimpleSpanProcessor`` without remote-parent
flags, an inner agent's span arrives first and becomes its own episode. An episode spread
over several processes (an agent calling a tool service that exports separately) is
assembled from what arrived when its local root did; put the Collector's ``groupbytrace``
processor in front of Ratchet for those (docs/ingest.md).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

AGENT = "agent"
GENAI = "genai"
OTHER = "other"
LOG = "log"


@dataclass(frozen=True, slots=True)
class Node:
    """A stored span or log record as the rules see it: ids, kind and flags, no payload."""

    row_id: int
    record_id: str
    span_id: str
    parent_span_id: str
    kind: str
    remote_parent: bool | None
    has_content: bool
    assembled: bool


@dataclass
class Episode:
    """One episode to assemble now: its spans and log records, and the span it is known by.

    ``agent`` is the ``invoke_agent`` span when there is one. ``key_span_id`` names the
    episode (its external id): the agent span, else the top of its tree, else (when the top's
    parent never arrived) that missing parent, which its sibling spans share. ``key_is_root``:
    the key span is the trace's root, so the trace id alone names the episode.
    """

    agent: Node | None
    spans: list[Node]
    logs: list[Node]
    key_span_id: str
    key_is_root: bool

    @property
    def rows(self) -> list[Node]:
        return [*self.spans, *self.logs]


@dataclass
class Plan:
    """What to do with a trace's waiting rows now; rows in no list keep waiting."""

    episodes: list[Episode] = field(default_factory=list)
    # Complete trees without a single GenAI span: rejected.
    unmapped: list[list[Node]] = field(default_factory=list)
    # Spans of complete trees outside every episode, and log records joined to nothing when
    # the trace is flushed: done, silently.
    context: list[Node] = field(default_factory=list)
    # Rows whose episode was assembled before they arrived: dropped, reported.
    late: list[Node] = field(default_factory=list)


def _late_spans(spans: dict[str, Node]) -> set[str]:
    """Waiting spans with an assembled ancestor. Memoized along each walk, so a long chain
    of spans costs linear time, and a parent cycle ends the walk."""
    tainted: dict[str, bool] = {}  # assembled, or below an assembled span
    for start in spans.values():
        path: list[str] = []
        on_path: set[str] = set()
        current: Node | None = start
        result = False
        while current is not None:
            if current.span_id in tainted:
                result = tainted[current.span_id]
                break
            if current.assembled:
                tainted[current.span_id] = result = True
                break
            if current.span_id in on_path:
                break  # a cycle with nothing assembled on it
            path.append(current.span_id)
            on_path.add(current.span_id)
            current = spans.get(current.parent_span_id) if current.parent_span_id else None
        for span_id in path:
            tainted[span_id] = result
    return {span_id for span_id, bad in tainted.items() if bad and not spans[span_id].assembled}


def _tops(waiting: dict[str, Node]) -> dict[str, Node]:
    """Each waiting span's top: the first ancestor whose parent is not waiting. Memoized like
    _late_spans, so a long chain costs linear time."""
    top_of: dict[str, Node] = {}
    for start in waiting.values():
        path: list[Node] = []
        seen: set[str] = set()
        current = start
        top: Node | None = None
        while True:
            if current.span_id in top_of:
                top = top_of[current.span_id]
                break
            path.append(current)
            seen.add(current.span_id)
            parent = waiting.get(current.parent_span_id)
            if parent is None or parent.span_id in seen:
                top = current
                break
            current = parent
        for node in path:
            top_of[node.span_id] = top
    return top_of


def _is_complete(top: Node, members: list[Node], spans: dict[str, Node]) -> bool:
    """Whether a tree can be assembled before the quiet period (see the module docstring)."""
    if not top.parent_span_id:
        return True
    if top.kind == AGENT and top.remote_parent is None and top.parent_span_id not in spans:
        return True  # the exporter does not say; the agent span closes its episode
    if top.remote_parent is True:
        # A local root: complete if an agent span is in it. Without one, more calls of the
        # same episode may still come under the same upstream parent: wait for quiet.
        return any(n.kind == AGENT for n in members)
    return False


def _outermost(top: Node, children: dict[str, list[Node]], kinds: set[str]) -> list[Node]:
    """The first nodes of ``kinds`` on every path down from ``top`` (breadth first)."""
    found: list[Node] = []
    queue = deque([top])
    seen: set[str] = set()
    while queue:
        node = queue.popleft()
        if node.span_id in seen:
            continue
        seen.add(node.span_id)
        if node.kind in kinds:
            found.append(node)
            continue
        queue.extend(children.get(node.span_id, ()))
    return found


def _subtree(anchor: Node, children: dict[str, list[Node]]) -> list[Node]:
    nodes: list[Node] = []
    stack = [anchor]
    seen: set[str] = set()
    while stack:
        node = stack.pop()
        if node.span_id in seen:
            continue
        seen.add(node.span_id)
        nodes.append(node)
        stack.extend(children.get(node.span_id, ()))
    return nodes


# A unit of assembly: its key (a top's span id, or the missing parent the tops share) and
# whether that key is the trace's root, mapped to its trees (each a top and its members).
Units = dict[tuple[str, bool], list[tuple[Node, list[Node]]]]


def plan_trace(nodes: list[Node], *, flush: bool) -> Plan:
    """Apply the module's rules to everything stored for one trace."""
    spans: dict[str, Node] = {}
    for node in nodes:
        if node.kind != LOG:
            spans.setdefault(node.span_id, node)
    plan = Plan()
    waiting = _waiting_spans(spans, plan)
    logs_by_span = _waiting_logs(nodes, spans, waiting, plan)
    claimed_logs: set[str] = set()
    for (key, key_is_root), unit in _units(waiting, spans, flush=flush).items():
        members = [n for _, tree in unit for n in tree]
        if not any(n.kind in (AGENT, GENAI) for n in members):
            plan.unmapped.append(members)
            continue
        if not flush and not any(
            n.has_content or any(log.has_content for log in logs_by_span.get(n.span_id, ()))
            for n in members
        ):
            continue  # the content may still come as log records
        found = _unit_episodes(unit, members, key, key_is_root, logs_by_span)
        plan.episodes.extend(found)
        claimed_logs.update(log.record_id for episode in found for log in episode.logs)
        _add_context(plan, members, found, logs_by_span, claimed_logs)
    if flush:
        plan.context.extend(
            log
            for logs in logs_by_span.values()
            for log in logs
            if log.record_id not in claimed_logs
        )
    return plan


def _waiting_spans(spans: dict[str, Node], plan: Plan) -> dict[str, Node]:
    """The spans not yet assembled that may still join an episode; late ones go to
    ``plan.late``."""
    late = _late_spans(spans)
    waiting: dict[str, Node] = {}
    for node in spans.values():
        if node.assembled:
            continue
        if node.span_id in late:
            plan.late.append(node)
        else:
            waiting[node.span_id] = node
    return waiting


def _waiting_logs(
    nodes: list[Node], spans: dict[str, Node], waiting: dict[str, Node], plan: Plan
) -> dict[str, list[Node]]:
    """The unassembled log records by span id; a record whose span is assembled or late is
    late itself."""
    logs_by_span: dict[str, list[Node]] = defaultdict(list)
    for node in nodes:
        if node.kind != LOG or node.assembled:
            continue
        owner = spans.get(node.span_id)
        if owner is not None and (owner.assembled or owner.span_id not in waiting):
            plan.late.append(node)
        else:
            logs_by_span[node.span_id].append(node)
    return logs_by_span


def _units(waiting: dict[str, Node], spans: dict[str, Node], *, flush: bool) -> Units:
    """The waiting spans as trees under their tops, grouped into units: a complete tree, or
    (when flushing) the trees whose tops share a parent that never came."""
    trees: dict[str, list[Node]] = defaultdict(list)
    tops: dict[str, Node] = {}
    for span_id, top in _tops(waiting).items():
        tops[top.span_id] = top
        trees[top.span_id].append(waiting[span_id])
    units: Units = defaultdict(list)
    for top_id, members in trees.items():
        top = tops[top_id]
        if not flush and not _is_complete(top, members, spans):
            continue
        if flush and top.parent_span_id and top.parent_span_id not in spans:
            units[(top.parent_span_id, False)].append((top, members))
        else:
            units[(top.span_id, not top.parent_span_id)].append((top, members))
    return units


def _unit_episodes(
    unit: list[tuple[Node, list[Node]]],
    members: list[Node],
    key: str,
    key_is_root: bool,
    logs_by_span: dict[str, list[Node]],
) -> list[Episode]:
    """A unit's episodes: one per outermost agent span, or (no agent span) one of all its
    GenAI spans under the unit's key."""
    children: dict[str, list[Node]] = defaultdict(list)
    for node in members:
        children[node.parent_span_id].append(node)
    agents = [a for top, _ in unit for a in _outermost(top, children, {AGENT})]
    if not agents:
        episode_spans = [n for n in members if n.kind == GENAI]
        logs = [log for n in episode_spans for log in logs_by_span.get(n.span_id, ())]
        return [Episode(None, episode_spans, logs, key, key_is_root)]
    found: list[Episode] = []
    for agent in agents:
        episode_spans = _subtree(agent, children)
        logs = [log for n in episode_spans for log in logs_by_span.get(n.span_id, ())]
        found.append(Episode(agent, episode_spans, logs, agent.span_id, not agent.parent_span_id))
    return found


def _add_context(
    plan: Plan,
    members: list[Node],
    found: list[Episode],
    logs_by_span: dict[str, list[Node]],
    claimed_logs: set[str],
) -> None:
    """A unit's spans outside its episodes, and their log records, are context."""
    in_episodes = {n.span_id for episode in found for n in episode.spans}
    for node in members:
        if node.span_id not in in_episodes:
            plan.context.append(node)
            for log in logs_by_span.get(node.span_id, ()):
                claimed_logs.add(log.record_id)
                plan.context.append(log)
