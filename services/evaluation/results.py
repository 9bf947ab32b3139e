"""The eval job's per-task results file: its name and how the worker reads it back.

The eval job writes ``<output_dir>/results.jsonl``, one JSON object per task (``task_id``,
the ``TaskSpec.task_id``; ``passed``, ``reward``, ``samples``, ``sample_passes``, …). The
loop reads it to record an evaluation, and to record a probe's pass rates. Standard library
only: the job imports the name, the worker the reader.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from services.chat.text import load_job_json

RESULTS_FILE = "results.jsonl"
MAX_JOB_FILE_BYTES = 256 << 20  # far above any results or metrics file; bounds the worker


class ResultsFileError(ValueError):
    """The results file is missing or not JSON lines of objects."""


def read_job_output(path: Path, *, limit: int = MAX_JOB_FILE_BYTES) -> str:
    """The text of a file a job wrote, read the way untrusted job output is read.

    The file must be a regular file (an ``lstat`` first, then ``O_NOFOLLOW``): a job that
    plants ``metrics.json -> /proc/self/environ`` gets an error, not the worker's
    environment in its run record. Raises ``FileNotFoundError`` when absent and
    ``OSError`` for anything refused.
    """
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} is not a regular file (symlinks are refused)")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data.decode("utf-8")


def read_results(output_dir: Path) -> list[dict[str, Any]]:
    """Every row of ``output_dir/results.jsonl``; raises :class:`ResultsFileError`."""
    path = output_dir / RESULTS_FILE
    try:
        text = read_job_output(path)
        rows = [load_job_json(line) for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ResultsFileError(f"cannot read evaluation results {path}: {exc}") from exc
    if not all(isinstance(row, dict) for row in rows):
        raise ResultsFileError(f"evaluation results {path} hold a line that is not an object")
    return rows


def pass_at_1(row: dict[str, Any]) -> float:
    """A task's pass@1 estimated from its samples (passes / samples), else its pass/fail.

    The evaluator rolls every task out ``samples`` times; the unbiased estimate of the
    probability that one rollout passes is the share of samples that passed.
    """
    counts = _sample_counts(row)
    if counts is not None:
        samples, passes = counts
        return passes / samples
    return 1.0 if row.get("passed") else 0.0


def pass_at_k(row: dict[str, Any], k: int) -> float | None:
    """A task's pass@k: the chance that at least one of ``k`` rollouts passes, estimated
    without bias from its ``n`` samples of which ``c`` passed (Chen et al. 2021, the Codex
    paper): ``1 - C(n-c, k) / C(n, k)``, computed as a product so large ``n`` never
    overflows. None when the task has fewer than ``k`` samples (the estimate needs ``k``
    draws without replacement); a row without sample counts has pass@k = its pass@1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    counts = _sample_counts(row)
    if counts is None:
        return pass_at_1(row) if k == 1 else None
    n, c = counts
    if n < k:
        return None
    if n - c < k:
        return 1.0
    all_fail = 1.0
    for drawn in range(n - c + 1, n + 1):
        all_fail *= 1.0 - k / drawn
    return 1.0 - all_fail


def mean_pass_at_k(rows: list[dict[str, Any]], k: int) -> float | None:
    """pass@k over a task set: the mean of its tasks' (None if any task has < k samples)."""
    values = [pass_at_k(row, k) for row in rows]
    if not values or any(value is None for value in values):
        return None
    return sum(value for value in values if value is not None) / len(values)


def reported_ks(samples: int) -> list[int]:
    """The k an evaluation of ``samples`` samples per task reports: 1, the powers of two
    below ``samples``, and ``samples`` itself (what RL could still reach at that budget)."""
    ks = [1]
    while ks[-1] * 2 < samples:
        ks.append(ks[-1] * 2)
    if samples > 1:
        ks.append(samples)
    return ks


def _sample_counts(row: dict[str, Any]) -> tuple[int, int] | None:
    samples = row.get("samples")
    passes = row.get("sample_passes")
    if (
        isinstance(samples, int)
        and not isinstance(samples, bool)
        and samples > 0
        and isinstance(passes, int)
        and not isinstance(passes, bool)
        and 0 <= passes <= samples
    ):
        return samples, passes
    return None
