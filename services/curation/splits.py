"""Which split a task belongs to: by cluster, stable, with a frozen held-out set.

- A failure task takes its **cluster's** split, so near-identical tasks never sit on both
  sides of the train/eval line. A cluster that already has tasks keeps their split; a new
  cluster gets one from the hash of its id (``heldout`` below ``heldout_fraction``, then
  ``eval`` below ``heldout_fraction + eval_fraction``, else ``train``), the same on every
  run and every machine.
- The **held-out** set is per loop and frozen: once it holds ``heldout_max_tasks`` tasks
  nothing enters it, and later tasks of held-out clusters go to ``eval`` (failures) or
  ``regression`` (successes), never ``train``. It is drawn from *all* curated traffic —
  failures and sampled successes alike, by the same cluster hash — so its pass rate is the
  served distribution's, not the champion's failures' (on which the champion scores ~0 by
  construction). Datasets carry it as their ``heldout`` file, which is evaluated for points
  gained and never trained on.
- Any other sampled **success** becomes a ``regression`` task in the tasks table. A dataset
  then splits them by cluster (:func:`replays_with_its_cluster`): a success whose cluster is
  on the trained side (it holds train tasks, or would if a failure came: its hash says
  ``train``) is **replay** (tasks the champion already handles, which rft replays so the
  candidate does not forget them); the others, and every pinned task, are the dataset's
  **regression** suite, which the gate checks a candidate on and which is never trained on.
  So a cluster is trained on (train, replay) or judged (eval, held-out, regression), never
  both, and a success keeps its side from one cycle to the next.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Split = Literal["train", "eval", "heldout", "regression"]
# A dataset's splits: the tasks table's, plus replay (regression tasks on the trained side).
DatasetSplit = Literal["train", "replay", "eval", "heldout", "regression"]
TRAINED_SPLITS: tuple[DatasetSplit, ...] = ("train", "replay")
JUDGED_SPLITS: tuple[DatasetSplit, ...] = ("eval", "heldout", "regression")
ClusterSplit = Literal["train", "eval", "heldout"]
Origin = Literal["failure", "success"]


def cluster_fraction(cluster_id: str) -> float:
    """A uniform number in [0, 1) fixed by the cluster id."""
    digest = hashlib.sha256(b"ratchet/split/" + cluster_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_for_cluster(
    cluster_id: str, *, eval_fraction: float, heldout_fraction: float
) -> ClusterSplit:
    """The split a new cluster gets from its id alone."""
    u = cluster_fraction(cluster_id)
    if u < heldout_fraction:
        return "heldout"
    if u < heldout_fraction + eval_fraction:
        return "eval"
    return "train"


def replays_with_its_cluster(
    cluster_id: str,
    stored_split: str | None,
    *,
    eval_fraction: float,
    heldout_fraction: float,
) -> bool:
    """Whether an unpinned success (a ``regression`` task) is on the trained side, so a
    dataset may replay it: its cluster's stored split (``train``, ``eval`` or ``heldout``,
    None for a cluster of successes only) is ``train``, or, with none stored, the split its
    hash gives (:func:`split_for_cluster`), which is the one the cluster's first failure
    would take. Either way the cluster never holds a task that judges a candidate."""
    split = stored_split or split_for_cluster(
        cluster_id, eval_fraction=eval_fraction, heldout_fraction=heldout_fraction
    )
    return split == "train"


class SplitAssigner:
    """Assigns splits to the new tasks of one batch, honouring the held-out cap.

    ``cluster_splits`` holds the split of every stored cluster the batch touches;
    ``heldout_count`` is how many held-out tasks the loop has now. Feed tasks in a fixed
    order (the pipeline sorts by content hash) so the cap falls on the same tasks every run.
    """

    def __init__(
        self,
        *,
        cluster_splits: dict[str, ClusterSplit],
        heldout_count: int,
        heldout_max_tasks: int,
        eval_fraction: float,
        heldout_fraction: float,
    ) -> None:
        self._clusters = dict(cluster_splits)
        self._heldout = heldout_count
        self._heldout_max = heldout_max_tasks
        self._eval_fraction = eval_fraction
        self._heldout_fraction = heldout_fraction

    def assign(self, cluster_id: str, origin: Origin) -> Split:
        if origin == "success":
            return self._assign_success(cluster_id)
        split = self._clusters.get(cluster_id)
        if split is None:
            split = self._hashed_split(cluster_id)
            self._clusters[cluster_id] = split
        if split == "heldout":
            if self._heldout >= self._heldout_max:
                return "eval"
            self._heldout += 1
        return split

    def _assign_success(self, cluster_id: str) -> Split:
        """Held-out when the cluster is (or hashes to) held-out and the set has room.

        A success never decides a cluster's train/eval split: only a held-out cluster takes
        its successes, so the held-out set samples successes and failures at the same rate.
        """
        split = self._clusters.get(cluster_id)
        if split is None:
            hashed = self._hashed_split(cluster_id)
            if hashed != "heldout":
                return "regression"
            split = hashed
        if split != "heldout" or self._heldout >= self._heldout_max:
            return "regression"
        self._clusters[cluster_id] = "heldout"
        self._heldout += 1
        return "heldout"

    def _hashed_split(self, cluster_id: str) -> ClusterSplit:
        """The split of a cluster the loop has not stored yet: its hash decides."""
        return split_for_cluster(
            cluster_id, eval_fraction=self._eval_fraction, heldout_fraction=self._heldout_fraction
        )
