"""Near-duplicate and cluster decisions for one batch of new tasks, as a pure function.

:func:`plan` takes the batch's new tasks (exact duplicates already collapsed by content
hash) and the stored tasks that share an LSH band with any of them, and decides for each new
task whether it is a **near duplicate** (estimated Jaccard >= ``near_duplicate_threshold``
*and* the same verifier: two prompts that read alike but are checked differently are
different tasks) or a **new task**, and which **cluster** a new task joins (Jaccard >=
``cluster_threshold``, any verifier).

Decisions are order-independent: links form connected components, and every choice inside a
component is made by a total order (highest similarity, then smallest task id or content
hash), never by arrival order. Stored tasks are never demoted: a component that reaches a
stored task attaches to it; a component of new tasks keeps its smallest content hash.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from services.curation.similarity import Signature, band_keys, jaccard_many, stack


@dataclass(frozen=True)
class NewTask:
    """A task proposed by this batch: ``weight`` traces led to exactly this content."""

    key: str
    verifier: str
    signature: Signature
    weight: int = 1


@dataclass(frozen=True)
class StoredTask:
    """A task already in the loop's table that shares an LSH band with the batch."""

    task_id: int
    key: str
    verifier: str
    signature: Signature
    cluster_id: str


@dataclass(frozen=True)
class Decision:
    """What happens to one new task.

    ``duplicate``: fold into ``target_task_id`` (a stored task) or ``target_key`` (another new
    task of this batch). ``new``: insert it, in cluster ``cluster_id``.
    """

    key: str
    kind: Literal["new", "duplicate"]
    cluster_id: str
    similarity: float = 1.0
    target_task_id: int | None = None
    target_key: str | None = None


class _UnionFind:
    def __init__(self, items: Iterable[str]) -> None:
        self._parent = {item: item for item in items}

    def find(self, item: str) -> str:
        root = item
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[item] != root:
            self._parent[item], item = root, self._parent[item]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # The smaller key becomes the root, so roots do not depend on union order.
            low, high = sorted((ra, rb))
            self._parent[high] = low

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for item in self._parent:
            out[self.find(item)].append(item)
        return out


@dataclass(frozen=True)
class _Link:
    a: str
    b: str | None  # another new task's key, or None when ``stored`` is set
    stored: StoredTask | None
    similarity: float


def _links(new: Sequence[NewTask], stored: Sequence[StoredTask]) -> list[_Link]:
    """Every pair (new-new and new-stored) that shares at least one LSH band."""
    new_bands = [band_keys(task.signature) for task in new]
    buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    for index, bands in enumerate(new_bands):
        for band in bands:
            buckets[band].append(index)
    stored_buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    for index, item in enumerate(stored):
        for band in band_keys(item.signature):
            stored_buckets[band].append(index)
    links: list[_Link] = []
    new_sigs = stack(t.signature for t in new)
    stored_sigs = stack(t.signature for t in stored)
    for index, task in enumerate(new):
        peers: set[int] = set()
        known: set[int] = set()
        for band in new_bands[index]:
            peers.update(i for i in buckets.get(band, ()) if i > index)
            known.update(stored_buckets.get(band, ()))
        if peers:
            order = sorted(peers)
            sims = jaccard_many(task.signature, new_sigs[order])
            links += [
                _Link(task.key, new[i].key, None, float(s))
                for i, s in zip(order, sims, strict=True)
            ]
        if known:
            order = sorted(known)
            sims = jaccard_many(task.signature, stored_sigs[order])
            links += [
                _Link(task.key, None, stored[i], float(s)) for i, s in zip(order, sims, strict=True)
            ]
    return links


def _best_stored(links: Iterable[_Link]) -> _Link | None:
    """The most similar stored task; ties go to the oldest (smallest id)."""

    def rank(link: _Link) -> tuple[float, int]:
        return link.similarity, -(link.stored.task_id if link.stored is not None else 0)

    return max(links, key=rank, default=None)


def plan(
    new: Sequence[NewTask],
    stored: Sequence[StoredTask],
    *,
    near_duplicate_threshold: float,
    cluster_threshold: float,
) -> dict[str, Decision]:
    """Decide, for every new task, duplicate-or-new and its cluster (see the module doc)."""
    if cluster_threshold > near_duplicate_threshold:
        raise ValueError("cluster_threshold must not exceed near_duplicate_threshold")
    keys = [t.key for t in new]
    if len(set(keys)) != len(keys):
        raise ValueError("new tasks must have distinct content hashes (collapse exact duplicates)")
    by_key = {t.key: t for t in new}
    links = _links(new, stored)

    def is_duplicate(link: _Link) -> bool:
        other = link.stored.verifier if link.stored is not None else by_key[link.b or ""].verifier
        return link.similarity >= near_duplicate_threshold and by_key[link.a].verifier == other

    dup_sets = _UnionFind(keys)
    dup_stored: dict[str, list[_Link]] = defaultdict(list)
    for link in links:
        if not is_duplicate(link):
            continue
        if link.stored is not None:
            dup_stored[link.a].append(link)
        elif link.b is not None:
            dup_sets.union(link.a, link.b)

    decisions: dict[str, Decision] = {}
    representatives: list[str] = []
    for root, members in dup_sets.groups().items():
        member_links = [link for m in members for link in dup_stored.get(m, ())]
        anchor = _best_stored(member_links)
        if anchor is None:
            representatives.append(root)
            for member in members:
                if member != root:
                    sim = _similarity(by_key[member], by_key[root])
                    decisions[member] = Decision(member, "duplicate", "", sim, target_key=root)
            continue
        assert anchor.stored is not None
        for member in members:
            direct = _best_stored(dup_stored.get(member, ()))
            target = direct or anchor
            assert target.stored is not None
            sim = target.similarity if direct is not None else anchor.similarity
            decisions[member] = Decision(
                member,
                "duplicate",
                target.stored.cluster_id,
                sim,
                target_task_id=target.stored.task_id,
            )

    _assign_clusters(representatives, links, cluster_threshold, decisions)
    for member, decision in list(decisions.items()):
        if decision.kind == "duplicate" and decision.target_key is not None:
            cluster = decisions[decision.target_key].cluster_id
            decisions[member] = Decision(
                member, "duplicate", cluster, decision.similarity, target_key=decision.target_key
            )
    return decisions


def _assign_clusters(
    representatives: Sequence[str],
    links: Sequence[_Link],
    threshold: float,
    decisions: dict[str, Decision],
) -> None:
    """Cluster the new representatives: join a stored cluster when linked, else their own."""
    reps = set(representatives)
    groups = _UnionFind(representatives)
    stored_links: dict[str, list[_Link]] = defaultdict(list)
    for link in links:
        if link.similarity < threshold or link.a not in reps:
            continue
        if link.stored is not None:
            stored_links[link.a].append(link)
        elif link.b in reps:
            groups.union(link.a, link.b)
    for root, members in groups.groups().items():
        anchor = _best_stored(link for m in members for link in stored_links.get(m, ()))
        cluster = anchor.stored.cluster_id if anchor is not None and anchor.stored else root
        for member in members:
            decisions[member] = Decision(member, "new", cluster)


def _similarity(a: NewTask, b: NewTask) -> float:
    return float(jaccard_many(a.signature, stack([b.signature]))[0])


def deduplicate(
    tasks: Sequence[NewTask], *, near_duplicate_threshold: float, cluster_threshold: float
) -> dict[str, int]:
    """The kept tasks of a set and their weights: ``{content hash: total weight}``.

    Exact duplicates (equal keys) are collapsed first, then near duplicates. The result does
    not depend on the order of ``tasks``, and deduplicating it again changes nothing.
    """
    collapsed: dict[str, NewTask] = {}
    for task in tasks:
        seen = collapsed.get(task.key)
        weight = task.weight + (seen.weight if seen else 0)
        collapsed[task.key] = NewTask(task.key, task.verifier, task.signature, weight)
    decisions = plan(
        list(collapsed.values()),
        [],
        near_duplicate_threshold=near_duplicate_threshold,
        cluster_threshold=cluster_threshold,
    )
    kept = {key: collapsed[key].weight for key, d in decisions.items() if d.kind == "new"}
    for key, decision in decisions.items():
        if decision.kind == "duplicate" and decision.target_key is not None:
            kept[decision.target_key] += collapsed[key].weight
    return kept
