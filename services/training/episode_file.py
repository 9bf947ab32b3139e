"""Episode files: the verified episodes a job keeps, and the demonstrations a train job reads.

Two files, one line format (``ratchet.episode/v1``, one JSON object per line)::

    {"task_id": "<content hash>", "passed": true, "reward": 1.0, "text": "...",
     "sequences": [[[ids...], [mask...]], ...], "checkpoint_id": "...", "family": "hf"}

- ``episodes.jsonl``, an **output** of the probe (eval) and train jobs: the episodes they
  sampled and verified (:func:`write_episodes`), listed in ``metrics.json`` as
  ``episode_file`` = ``{"file", "bytes", "sha256", "count", "kinds"}`` where ``kinds`` is the
  subset of ``["success", "failure"]`` the file holds. The worker trusts the file only as
  far as that listing: :func:`read_listed_episodes` refuses a file of another name, size or
  digest, a line count other than ``count``, a line of an undeclared kind, or a malformed
  line, with an :class:`EpisodeFileError` that names the line and field.
- ``demonstrations.jsonl``, an **input** of the train job (spec key ``demonstrations``):
  the stored episodes of its tasks, written by the worker
  (services.curation.demonstrations) and read by rft and dpo (:func:`read_demonstrations`).

``sequences`` are exactly the token ids the model sampled and saw, with the mask that says
which ids are its own (training targets), as :attr:`TokenEpisode.sequences` gives them, so
rft and dpo train on the episode byte for byte. Standard library only: the job writes the
file, the worker reads it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.chat.text import load_job_json, valid_text
from services.evaluation.results import read_job_output

EPISODES_FILE = "episodes.jsonl"
DEMONSTRATIONS_FILE = "demonstrations.jsonl"
EPISODE_KINDS = ("success", "failure")
MAX_EPISODES_BYTES = 64 << 20  # bounds what the worker reads from one job
MAX_TEXT_CHARS = 20_000  # an episode's text as shown on the task page


class EpisodeFileError(ValueError):
    """An episode file that its listing does not vouch for, or a malformed line."""


@dataclass(frozen=True)
class EpisodeRecord:
    """One verified episode of one task, as the files hold it."""

    task_id: str  # the task's content hash (TaskSpec.task_id)
    passed: bool
    reward: float
    text: str
    sequences: list[tuple[list[int], list[bool]]]
    checkpoint_id: str | None
    family: str

    @property
    def kind(self) -> str:
        return "success" if self.passed else "failure"

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.sequences)

    def to_json(self) -> str:
        row = asdict(self)
        row["text"] = valid_text(self.text)  # no model text leaves a job unstorable
        row["sequences"] = [[list(ids), [bool(m) for m in mask]] for ids, mask in self.sequences]
        return json.dumps(row, sort_keys=True, separators=(",", ":"))


def write_episodes(output_dir: Path, records: Sequence[EpisodeRecord]) -> dict[str, Any]:
    """Write ``episodes.jsonl`` atomically; its listing for ``metrics.json``."""
    data = "".join(record.to_json() + "\n" for record in records).encode("utf-8")
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / EPISODES_FILE
    tmp = path.with_name(f".{EPISODES_FILE}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    kinds = sorted({record.kind for record in records})
    return {
        "file": EPISODES_FILE,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "count": len(records),
        "kinds": kinds,
    }


def read_listed_episodes(output_dir: Path, metrics: Mapping[str, Any]) -> list[EpisodeRecord]:
    """The episodes a job's ``metrics.json`` lists (none when it lists none); see the module."""
    listing = metrics.get("episode_file")
    if listing is None:
        return []
    if not isinstance(listing, Mapping):
        raise EpisodeFileError("metrics.episode_file must be an object (file, bytes, sha256, ...)")
    if listing.get("file") != EPISODES_FILE:
        raise EpisodeFileError(
            f"metrics.episode_file.file must be {EPISODES_FILE!r}, got {listing.get('file')!r}"
        )
    size, count = _count(listing, "bytes"), _count(listing, "count")
    kinds = listing.get("kinds")
    if (
        not isinstance(kinds, list)
        or not all(kind in EPISODE_KINDS for kind in kinds if isinstance(kind, str))
        or not all(isinstance(kind, str) for kind in kinds)
        or (not kinds and count > 0)
    ):
        raise EpisodeFileError(
            f"metrics.episode_file.kinds must be a list of {list(EPISODE_KINDS)}"
        )
    if size > MAX_EPISODES_BYTES:
        raise EpisodeFileError(f"metrics.episode_file.bytes is over the {MAX_EPISODES_BYTES} limit")
    path = output_dir / EPISODES_FILE
    try:
        data = read_job_output(path, limit=MAX_EPISODES_BYTES).encode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EpisodeFileError(f"cannot read the episodes {path}: {exc}") from None
    if len(data) != size:
        raise EpisodeFileError(f"{path} has {len(data)} bytes, its listing says {size}")
    if hashlib.sha256(data).hexdigest() != listing.get("sha256"):
        raise EpisodeFileError(f"{path} does not match the sha256 its listing gives")
    records = parse_episode_lines(data.decode("utf-8").splitlines(), where=EPISODES_FILE)
    if len(records) != count:
        raise EpisodeFileError(f"{path} holds {len(records)} episodes, its listing says {count}")
    undeclared = sorted({record.kind for record in records} - set(kinds))
    if undeclared:
        raise EpisodeFileError(
            f"{path} holds {undeclared[0]} episodes its listing does not declare"
        )
    return records


def keep_episodes_option(raw: Mapping[str, Any]) -> int:
    """The spec's ``keep_episodes`` (how many successes and failures of each task a job
    keeps in ``episodes.jsonl``): 0 (keep none) when absent; :class:`EpisodeFileError`
    when not a non-negative integer."""
    value = raw.get("keep_episodes", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpisodeFileError("spec 'keep_episodes' must be a non-negative integer")
    return value


def write_demonstrations(path: Path, records: Iterable[EpisodeRecord]) -> int:
    """Write a train job's ``demonstrations.jsonl`` atomically; how many lines it holds."""
    lines = [record.to_json() + "\n" for record in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    tmp.replace(path)
    return len(lines)


def read_demonstrations(path: Path) -> list[EpisodeRecord]:
    """A train job's demonstrations file; :class:`EpisodeFileError` names a bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EpisodeFileError(f"cannot read the demonstrations {path}: {exc}") from None
    return parse_episode_lines(text.splitlines(), where=path.name)


def parse_episode_lines(lines: Sequence[str], *, where: str) -> list[EpisodeRecord]:
    """Episode lines (blank lines skipped) as records; the error names line and field."""
    records: list[EpisodeRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = load_job_json(line)
        except (ValueError, RecursionError) as exc:
            raise EpisodeFileError(f"{where} line {number} is not JSON: {exc}") from None
        records.append(_record(row, f"{where} line {number}"))
    return records


def _record(row: Any, where: str) -> EpisodeRecord:
    if not isinstance(row, dict):
        raise EpisodeFileError(f"{where} is not an object")
    task_id, text, family = row.get("task_id"), row.get("text"), row.get("family")
    if not isinstance(task_id, str) or not 1 <= len(task_id) <= 64:
        raise EpisodeFileError(f"{where}: task_id must be a task's content hash")
    if not isinstance(row.get("passed"), bool):
        raise EpisodeFileError(f"{where}: passed must be true or false")
    reward = row.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EpisodeFileError(f"{where}: reward must be a finite number")
    if not isinstance(text, str):
        raise EpisodeFileError(f"{where}: text must be a string")
    if not isinstance(family, str) or not 1 <= len(family) <= 32:
        raise EpisodeFileError(f"{where}: family must be a model family name")
    checkpoint = row.get("checkpoint_id")
    if checkpoint is not None and (not isinstance(checkpoint, str) or len(checkpoint) > 128):
        raise EpisodeFileError(f"{where}: checkpoint_id must be a checkpoint id or null")
    return EpisodeRecord(
        task_id=task_id,
        passed=row["passed"],
        reward=float(reward),
        text=text[:MAX_TEXT_CHARS],
        sequences=_sequences(row.get("sequences"), where),
        checkpoint_id=checkpoint,
        family=family,
    )


def _sequences(value: Any, where: str) -> list[tuple[list[int], list[bool]]]:
    """``[[ids, mask], ...]``: ids non-negative ints, a mask of as many booleans."""
    if not isinstance(value, list) or not value:
        raise EpisodeFileError(f"{where}: sequences must be a non-empty list of [ids, mask]")
    out: list[tuple[list[int], list[bool]]] = []
    for index, item in enumerate(value):
        field = f"{where}: sequences[{index}]"
        if not isinstance(item, list) or len(item) != 2:
            raise EpisodeFileError(f"{field} must be [ids, mask]")
        ids, mask = item
        if not isinstance(ids, list) or not ids or not all(_token(i) for i in ids):
            raise EpisodeFileError(f"{field} ids must be a non-empty list of token ids")
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise EpisodeFileError(f"{field} mask must have one boolean per id")
        if not all(isinstance(m, bool) for m in mask):
            raise EpisodeFileError(f"{field} mask must be booleans (true on the model's ids)")
        out.append((list(ids), list(mask)))
    return out


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(listing: Mapping[str, Any], key: str) -> int:
    value = listing.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpisodeFileError(f"metrics.episode_file.{key} must be a non-negative integer")
    return value
