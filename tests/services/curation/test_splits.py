"""Splits: by cluster, stable, a frozen held-out set of all traffic, successes to regression."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from services.curation.splits import (
    SplitAssigner,
    cluster_fraction,
    replays_with_its_cluster,
    split_for_cluster,
)


def new_loop_assigner(*, heldout_max_tasks: int) -> SplitAssigner:
    """The assigner of a loop with no stored clusters, at the default policy's fractions."""
    return SplitAssigner(
        cluster_splits={},
        heldout_count=0,
        heldout_max_tasks=heldout_max_tasks,
        eval_fraction=0.2,
        heldout_fraction=0.1,
    )


def test_split_is_a_stable_function_of_the_cluster_id() -> None:
    ids = [f"cluster-{i}" for i in range(2000)]
    first = [split_for_cluster(c, eval_fraction=0.2, heldout_fraction=0.1) for c in ids]
    again = [split_for_cluster(c, eval_fraction=0.2, heldout_fraction=0.1) for c in ids]
    assert first == again
    share = {s: first.count(s) / len(ids) for s in ("train", "eval", "heldout")}
    assert 0.15 < share["eval"] < 0.25
    assert 0.06 < share["heldout"] < 0.14
    assert all(0.0 <= cluster_fraction(c) < 1.0 for c in ids[:50])


def test_heldout_set_freezes_at_its_cap() -> None:
    heldout_clusters = [
        c
        for c in (f"c{i}" for i in range(500))
        if split_for_cluster(c, eval_fraction=0.2, heldout_fraction=0.1) == "heldout"
    ]
    assigner = new_loop_assigner(heldout_max_tasks=3)
    got = [assigner.assign(c, "failure") for c in heldout_clusters[:6]]
    assert got == ["heldout"] * 3 + ["eval"] * 3


def test_stored_cluster_split_wins_and_successes_go_to_regression() -> None:
    assigner = SplitAssigner(
        cluster_splits={"a": "train", "b": "eval"},
        heldout_count=0,
        heldout_max_tasks=10,
        eval_fraction=0.5,
        heldout_fraction=0.4,
    )
    assert assigner.assign("a", "failure") == "train"
    assert assigner.assign("b", "failure") == "eval"
    assert assigner.assign("a", "success") == "regression"


@settings(max_examples=200, deadline=None)
@given(
    assignments=st.lists(
        st.tuples(
            st.integers(0, 30).map(lambda i: f"cluster-{i}"),
            st.sampled_from(["failure", "success"]),
        ),
        max_size=80,
    ),
    stored=st.dictionaries(
        st.integers(0, 30).map(lambda i: f"cluster-{i}"),
        st.sampled_from(["train", "eval", "heldout"]),
        max_size=10,
    ),
    eval_fraction=st.floats(0.0, 0.5),
    heldout_fraction=st.floats(0.0, 0.45),
    heldout_count=st.integers(0, 5),
    heldout_max=st.integers(0, 8),
)
def test_a_cluster_never_spans_train_and_eval(
    assignments: list[tuple[str, str]],
    stored: dict[str, str],
    eval_fraction: float,
    heldout_fraction: float,
    heldout_count: int,
    heldout_max: int,
) -> None:
    assigner = SplitAssigner(
        cluster_splits=stored,  # type: ignore[arg-type]
        heldout_count=heldout_count,
        heldout_max_tasks=heldout_max,
        eval_fraction=eval_fraction,
        heldout_fraction=heldout_fraction,
    )
    seen: dict[str, set[str]] = defaultdict(set)
    for cluster, split in stored.items():
        seen[cluster].add(split)
    heldout = heldout_count
    for cluster, origin in assignments:
        split = assigner.assign(cluster, origin)  # type: ignore[arg-type]
        seen[cluster].add(split)
        heldout += split == "heldout"
        if origin == "success":
            assert split in ("regression", "heldout")
    for splits in seen.values():
        assert not ("train" in splits and splits & {"eval", "heldout"})
    assert heldout <= max(heldout_max, heldout_count)


def test_heldout_samples_successes_and_failures_alike() -> None:
    """The held-out set is the served distribution: both outcomes, by the same cluster hash."""
    assigner = new_loop_assigner(heldout_max_tasks=10_000)
    clusters = [f"c{i}" for i in range(4000)]
    failures = [assigner.assign(c, "failure") for c in clusters[:2000]]
    successes = [assigner.assign(c, "success") for c in clusters[2000:]]
    assert 0.06 < failures.count("heldout") / 2000 < 0.14
    assert 0.06 < successes.count("heldout") / 2000 < 0.14
    assert set(successes) == {"heldout", "regression"}
    # A failure arriving later in a held-out success's cluster stays held out.
    heldout_success = clusters[2000 + successes.index("heldout")]
    assert assigner.assign(heldout_success, "failure") == "heldout"


def test_a_success_never_enters_a_full_heldout_set_or_a_train_cluster() -> None:
    heldout_cluster = next(
        c
        for c in (f"c{i}" for i in range(500))
        if split_for_cluster(c, eval_fraction=0.2, heldout_fraction=0.1) == "heldout"
    )
    full = SplitAssigner(
        cluster_splits={"t": "train"},
        heldout_count=3,
        heldout_max_tasks=3,
        eval_fraction=0.2,
        heldout_fraction=0.1,
    )
    assert full.assign(heldout_cluster, "success") == "regression"
    assert full.assign("t", "success") == "regression"


def test_a_success_is_replayed_only_on_the_trained_side_of_the_line() -> None:
    """A success is replayed when its cluster is a train cluster, or (successes only so
    far) would be one: where its cluster's first failure would go. Eval and held-out
    clusters' successes judge instead."""
    fractions = {"eval_fraction": 0.2, "heldout_fraction": 0.1}
    assert replays_with_its_cluster("c", "train", **fractions)
    assert not replays_with_its_cluster("c", "eval", **fractions)
    assert not replays_with_its_cluster("c", "heldout", **fractions)
    for cluster in (f"cluster-{i}" for i in range(200)):
        hashed = split_for_cluster(cluster, **fractions)
        assert replays_with_its_cluster(cluster, None, **fractions) == (hashed == "train")
