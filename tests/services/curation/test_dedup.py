"""Deduplication: exact and near duplicates, clusters, order independence and idempotence."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.curation import similarity
from services.curation.dedup import NewTask, StoredTask, deduplicate, plan
from services.environments.base import TaskSpec

BASES = [
    "Where is my order number 48213? It was supposed to arrive on Monday morning.",
    "How do I reset the password of my account? The reset link has expired twice.",
    "Cancel my subscription to the premium plan and refund the last invoice please.",
    "The export to CSV fails with a timeout when the report has many rows in it.",
    "Please change the delivery address of my open order to the new office in Berlin.",
]
EDITS = ["", " thanks", "!", " Thanks a lot.", " please", "  ", " ASAP"]


def jaccard(a: similarity.Signature, b: similarity.Signature) -> float:
    """The MinHash estimate of two shingle sets' Jaccard similarity, one pair at a time."""
    return float(similarity.jaccard_many(a, similarity.stack([b]))[0])


def task(text: str, verifier: str = "v", weight: int = 1) -> NewTask:
    key = hashlib.sha256(f"{verifier}|{similarity.normalize_prompt(text)}".encode()).hexdigest()
    return NewTask(key, verifier, similarity.signature(text), weight)


tasks_strategy = st.lists(
    st.builds(
        lambda base, edit, verifier, weight: task(BASES[base] + EDITS[edit], verifier, weight),
        st.integers(0, len(BASES) - 1),
        st.integers(0, len(EDITS) - 1),
        st.sampled_from(["v", "v", "w"]),
        st.integers(1, 3),
    ),
    max_size=14,
)
THRESHOLDS = {"near_duplicate_threshold": 0.85, "cluster_threshold": 0.6}


@settings(max_examples=60, deadline=None)
@given(tasks=tasks_strategy, seed=st.integers(0, 2**16))
def test_dedup_is_order_independent(tasks: list[NewTask], seed: int) -> None:
    shuffled = list(tasks)
    random.Random(seed).shuffle(shuffled)
    assert deduplicate(tasks, **THRESHOLDS) == deduplicate(shuffled, **THRESHOLDS)


@settings(max_examples=60, deadline=None)
@given(tasks=tasks_strategy)
def test_dedup_is_idempotent_and_keeps_every_trace(tasks: list[NewTask]) -> None:
    kept = deduplicate(tasks, **THRESHOLDS)
    by_key = {t.key: t for t in tasks}
    again = deduplicate(
        [NewTask(k, by_key[k].verifier, by_key[k].signature, w) for k, w in kept.items()],
        **THRESHOLDS,
    )
    assert again == kept
    assert sum(kept.values()) == sum(t.weight for t in tasks)


def test_near_duplicates_fold_into_the_smallest_key() -> None:
    a = task(BASES[0])
    b = task(BASES[0] + " thanks")
    c = task(BASES[1])
    kept = deduplicate([a, b, c], **THRESHOLDS)
    assert kept == {min(a.key, b.key): 2, c.key: 1}


def test_a_different_verifier_is_a_different_task_in_the_same_cluster() -> None:
    a = task(BASES[0], verifier="v")
    b = task(BASES[0] + " thanks", verifier="w")
    decisions = plan([a, b], [], **THRESHOLDS)
    assert {d.kind for d in decisions.values()} == {"new"}
    assert decisions[a.key].cluster_id == decisions[b.key].cluster_id == min(a.key, b.key)


def test_new_tasks_attach_to_stored_tasks_and_clusters() -> None:
    stored = task(BASES[0])
    kept = StoredTask(7, stored.key, "v", stored.signature, "cluster-7")
    dup = task(BASES[0] + "!")
    cousin = task(BASES[0] + " Thanks a lot.", verifier="w")
    stranger = task(BASES[3])
    decisions = plan([dup, cousin, stranger], [kept], **THRESHOLDS)
    assert decisions[dup.key].kind == "duplicate"
    assert decisions[dup.key].target_task_id == 7
    assert decisions[cousin.key].kind == "new"
    assert decisions[cousin.key].cluster_id == "cluster-7"
    assert decisions[stranger.key].cluster_id == stranger.key


def test_plan_refuses_inconsistent_input() -> None:
    a = task(BASES[0])
    with pytest.raises(ValueError, match="distinct content hashes"):
        plan([a, a], [], **THRESHOLDS)
    with pytest.raises(ValueError, match="must not exceed"):
        plan([a], [], near_duplicate_threshold=0.6, cluster_threshold=0.8)


def test_signatures_are_stable_and_round_trip() -> None:
    sig = similarity.signature("Where is my order?")
    assert sig.dtype == np.uint32 and sig.shape == (similarity.NUM_PERM,)
    assert np.array_equal(sig, similarity.signature("where   is my ORDER?"))
    raw = similarity.signature_to_bytes(sig)
    assert len(raw) == 4 * similarity.NUM_PERM
    assert np.array_equal(similarity.signature_from_bytes(raw), sig)
    assert len(similarity.band_keys(sig)) == similarity.BANDS
    with pytest.raises(ValueError, match="expected 512"):
        similarity.signature_from_bytes(b"short")


def test_dedup_key_normalizes_whitespace_only() -> None:
    common: dict[str, Any] = {"environment": "qa", "tools": [], "verifier": {"reward_id": "r"}}
    a = similarity.dedup_key(TaskSpec.create(prompt="Hello  world\n", **common))
    b = similarity.dedup_key(TaskSpec.create(prompt="Hello world", **common))
    c = similarity.dedup_key(TaskSpec.create(prompt="hello world", **common))
    assert a == b != c


def test_similarity_tracks_jaccard() -> None:
    same = jaccard(similarity.signature(BASES[0]), similarity.signature(BASES[0]))
    close = jaccard(similarity.signature(BASES[0]), similarity.signature(BASES[0] + " thanks"))
    far = jaccard(similarity.signature(BASES[0]), similarity.signature(BASES[2]))
    assert same == 1.0
    assert close > 0.85 > 0.2 > far


def _reference_pairs(
    new: list[NewTask], stored: list[StoredTask]
) -> set[tuple[str, str | int, float]]:
    """Band sharing by the definition: some band's bytes equal, compared pair by pair."""
    pairs: set[tuple[str, str | int, float]] = set()
    for i, a in enumerate(new):
        bands = set(similarity.band_keys(a.signature))
        for b in new[i + 1 :]:
            if bands & set(similarity.band_keys(b.signature)):
                pairs.add((a.key, b.key, jaccard(a.signature, b.signature)))
        for s in stored:
            if bands & set(similarity.band_keys(s.signature)):
                pairs.add((a.key, s.task_id, jaccard(a.signature, s.signature)))
    return pairs


@settings(max_examples=60, deadline=None)
@given(
    picks=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=25),
    stored_picks=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=25),
)
def test_links_are_exactly_the_pairs_that_share_a_band(
    picks: list[tuple[int, int]], stored_picks: list[tuple[int, int]]
) -> None:
    from services.curation.dedup import _links

    new = list({t.key: t for t in (task(BASES[b] + EDITS[e]) for b, e in picks)}.values())
    stored = [
        StoredTask(100 + n, f"s{n}", "v", similarity.signature(BASES[b] + EDITS[e] + " x"), "c")
        for n, (b, e) in enumerate(stored_picks)
    ]
    found = {
        (link.a, link.b if link.stored is None else link.stored.task_id, link.similarity)
        for link in _links(new, stored)
    }
    assert found == _reference_pairs(new, stored)
