"""`ratchet job train|eval --spec spec.json`: the job contract's entry points.

Imports are lazy and go straight to the job modules, so a job process loads torch and the
standard library only: nothing from the api, the database or the workflows.
"""

from __future__ import annotations

import argparse
from typing import Any

from services.cli.common import add_command


def register(subparsers: Any) -> None:
    job = add_command(
        subparsers, "job", _run_job, help="run a training or evaluation job (what executors start)"
    )
    kinds = job.add_subparsers(dest="job_kind", metavar="KIND", required=True)
    for kind, help_text in (
        ("train", "train a candidate (GRPO or SFT)"),
        ("eval", "evaluate a checkpoint on a task set"),
    ):
        parser = kinds.add_parser(kind, help=help_text)
        parser.add_argument("--spec", required=True, help="path of the job spec JSON")
        parser.set_defaults(func=_run_job)


def _run_job(args: argparse.Namespace) -> int:
    """Run one job of the job contract: read the spec (and RATCHET_DATASET,
    RATCHET_BASE_CHECKPOINT, RATCHET_OUTPUT_DIR), write checkpoint/ and metrics.json into the
    output dir, exit 0 or non-zero with the reason on stderr.
    """
    argv = ["--spec", args.spec]
    if args.job_kind == "train":
        from services.training.job import train_job_main

        return train_job_main(argv)
    from services.evaluation.job import eval_job_main

    return eval_job_main(argv)
