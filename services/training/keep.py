"""What a job keeps of the episodes it sampled: verified successes, and failures beside them.

Every rollout a job's verifier passed is worth keeping: a success found once in 64 samples
is a demonstration the next cycle can train on (rft) and, with a failure of the same task,
a preference pair (dpo). :class:`EpisodeKeeper` collects them as the trainers and the probe
sample, at most ``per_task`` successes and ``per_task`` failures of each task (the first
ones seen), and turns them into :class:`~services.training.episode_file.EpisodeRecord` lines
with their exact token ids and the decoded text, for ``episodes.jsonl``.

A train job keeps a task's failures only when the task also has a success (the failure is
then one side of a pair); the probe keeps both (``failures_alone=True``): its failures are
what the task page shows of a task nobody solved yet. Under ``torchrun`` each rank keeps
what it sampled and rank 0 writes, so a file holds rank 0's share.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.training.episode_file import MAX_TEXT_CHARS, EpisodeRecord
from services.training.family import FamilyModel, TokenEpisode


class EpisodeKeeper:
    """Collects a job's verified episodes, bounded per task (see the module)."""

    def __init__(self, model: FamilyModel, *, per_task: int, failures_alone: bool) -> None:
        if per_task < 1:
            raise ValueError(f"keep_episodes must be at least 1, got {per_task}")
        self._model = model
        self._per_task = per_task
        self._failures_alone = failures_alone
        self._kept: dict[str, dict[bool, list[EpisodeRecord]]] = {}

    def add(self, episodes: Iterable[TokenEpisode]) -> None:
        """Keep each episode that has a model turn, while its task's kind has room."""
        for episode in episodes:
            if not episode.turns:
                continue
            kinds = self._kept.setdefault(episode.task.task_id, {True: [], False: []})
            kept = kinds[bool(episode.reward.passed)]
            if len(kept) < self._per_task:
                kept.append(self._record(episode))

    def records(self) -> list[EpisodeRecord]:
        """The kept episodes, task by task (first seen first), successes before failures."""
        out: list[EpisodeRecord] = []
        for kinds in self._kept.values():
            out.extend(kinds[True])
            if kinds[True] or self._failures_alone:
                out.extend(kinds[False])
        return out

    def _record(self, episode: TokenEpisode) -> EpisodeRecord:
        sequences = [(list(ids), [bool(m) for m in mask]) for ids, mask in episode.sequences]
        return EpisodeRecord(
            task_id=episode.task.task_id,
            passed=bool(episode.reward.passed),
            reward=float(episode.reward.total),
            text=self._text(sequences)[:MAX_TEXT_CHARS],
            sequences=sequences,
            checkpoint_id=self._model.checkpoint_id,
            family=self._model.family,
        )

    def _text(self, sequences: list[tuple[list[int], list[bool]]]) -> str:
        """The episode as its tokenizer reads it back (the last, longest sequence holds the
        whole conversation when the turns share a prefix); ids when the family has no
        tokenizer to decode with."""
        decode = getattr(getattr(self._model, "tokenizer", None), "decode", None)
        parts = []
        for ids, _ in sequences:
            parts.append(str(decode(ids)) if callable(decode) else " ".join(map(str, ids)))
        return "\n".join(parts)
