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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from services.curation.similarity import BANDS, ROWS, Signature, jaccard_many, stack


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


def _links(
    new: Sequence[NewTask], stored: Sequence[StoredTask], *, min_similarity: float = 0.0
) -> list[_Link]:
    """Every pair (new-new and new-stored) that shares at least one LSH band and is at least
    ``min_similarity`` alike (:func:`plan` asks for its cluster threshold: no decision
    looks at a less similar pair, and a batch of a large loop meets tens of thousands).

    A batch meets thousands of stored neighbours, so bands are not compared as Python
    objects: every band of every signature is folded into one 64-bit number (numpy, all at
    once), ``np.isin`` finds the stored bands that any new band may equal, and only those
    candidates are checked exactly, band bytes against band bytes. Equal bands always fold
    to equal numbers, so no pair is missed; the exact check drops fold collisions, so no
    pair is invented: the pairs are exactly those that share a band.
    """
    new_sigs = stack(t.signature for t in new)
    stored_sigs = stack(t.signature for t in stored)
    new_folds = _band_folds(new_sigs)
    buckets: dict[int, list[int]] = defaultdict(list)
    for index, row in enumerate(new_folds.tolist()):
        for fold in row:
            buckets[fold].append(index)
    peers: list[set[int]] = [set() for _ in new]
    for members in buckets.values():
        if len(members) > 1:
            for position, index in enumerate(members):
                peers[index].update(members[position + 1 :])
    known: list[set[int]] = [set() for _ in new]
    if len(stored):
        stored_folds = _band_folds(stored_sigs)
        hits = np.isin(stored_folds, new_folds)
        for stored_index, band in zip(*np.nonzero(hits), strict=True):
            for index in buckets[int(stored_folds[stored_index, band])]:
                known[index].add(int(stored_index))
    links: list[_Link] = []
    for index, task in enumerate(new):
        for i, sim in _sharing(task.signature, new_sigs, peers[index], min_similarity):
            links.append(_Link(task.key, new[i].key, None, sim))
        for i, sim in _sharing(task.signature, stored_sigs, known[index], min_similarity):
            links.append(_Link(task.key, None, stored[i], sim))
    return links


def _sharing(
    sig: Signature, others: npt.NDArray[np.uint32], candidates: set[int], min_similarity: float
) -> list[tuple[int, float]]:
    """``(index, similarity)`` of the candidates that really share a band with ``sig`` and
    are at least ``min_similarity`` alike, in index order."""
    if not candidates:
        return []
    order = sorted(candidates)
    rows = others[order]
    bands = rows[:, : BANDS * ROWS].reshape(-1, BANDS, ROWS)
    shared = (bands == sig[: BANDS * ROWS].reshape(BANDS, ROWS)).all(axis=2).any(axis=1)
    sims = jaccard_many(sig, rows)
    keep = (shared & (sims >= min_similarity)).tolist()
    return [(i, s) for i, s, ok in zip(order, sims.tolist(), keep, strict=True) if ok]


# Odd 64-bit multipliers: a band's four rows and its number fold into one word (mod 2**64).
_FOLD = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
    dtype=np.uint64,
)
_BAND_SALT = (np.arange(BANDS, dtype=np.uint64) + np.uint64(1)) * np.uint64(0xFF51AFD7ED558CCD)


def _band_folds(signatures: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
    """``(n, BANDS)``: each band of each signature folded into one 64-bit number."""
    head = signatures[:, : BANDS * ROWS].reshape(-1, BANDS, ROWS).astype(np.uint64)
    folded: npt.NDArray[np.uint64] = (head * _FOLD).sum(axis=2, dtype=np.uint64) ^ _BAND_SALT
    return folded


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
    links = _links(new, stored, min_similarity=cluster_threshold)
    dup_sets, dup_stored = _duplicate_links(links, by_key, near_duplicate_threshold)
    decisions: dict[str, Decision] = {}
    representatives: list[str] = []
    for root, members in dup_sets.groups().items():
        if not _decide_group(root, members, dup_stored, by_key, decisions):
            representatives.append(root)
    _assign_clusters(representatives, links, cluster_threshold, decisions)
    for member, decision in list(decisions.items()):
        if decision.kind == "duplicate" and decision.target_key is not None:
            cluster = decisions[decision.target_key].cluster_id
            decisions[member] = Decision(
                member, "duplicate", cluster, decision.similarity, target_key=decision.target_key
            )
    return decisions


def _duplicate_links(
    links: Sequence[_Link], by_key: Mapping[str, NewTask], threshold: float
) -> tuple[_UnionFind, dict[str, list[_Link]]]:
    """The near-duplicate links (at least ``threshold`` alike, the same verifier): the new
    tasks joined into sets of duplicates of each other, and each new task's links to
    stored tasks it duplicates."""
    dup_sets = _UnionFind(list(by_key))
    dup_stored: dict[str, list[_Link]] = defaultdict(list)
    for link in links:
        other = link.stored.verifier if link.stored is not None else by_key[link.b or ""].verifier
        if link.similarity < threshold or by_key[link.a].verifier != other:
            continue
        if link.stored is not None:
            dup_stored[link.a].append(link)
        elif link.b is not None:
            dup_sets.union(link.a, link.b)
    return dup_sets, dup_stored


def _decide_group(
    root: str,
    members: Sequence[str],
    dup_stored: Mapping[str, list[_Link]],
    by_key: Mapping[str, NewTask],
    decisions: dict[str, Decision],
) -> bool:
    """Decide a set of new tasks that duplicate each other: each a duplicate of the stored
    task it is closest to, or of the one the set is closest to (True); without a stored
    duplicate, the others are duplicates of ``root``, which is new (False)."""
    anchor = _best_stored(link for m in members for link in dup_stored.get(m, ()))
    if anchor is None:
        for member in members:
            if member != root:
                sim = _similarity(by_key[member], by_key[root])
                decisions[member] = Decision(member, "duplicate", "", sim, target_key=root)
        return False
    for member in members:
        direct = _best_stored(dup_stored.get(member, ()))
        target = direct or anchor
        assert target.stored is not None
        decisions[member] = Decision(
            member,
            "duplicate",
            target.stored.cluster_id,
            target.similarity,
            target_task_id=target.stored.task_id,
        )
    return True


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
