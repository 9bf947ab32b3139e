"""replay split and calibration runs

The replay split: the successes a dataset may train on, apart from the ones that judge.

A dataset's sampled successes were one ``regression`` split that the gate judged a
candidate on and rft replayed, so the regression suite was trained on. Now a snapshot puts
the successes of clusters on the trained side into ``replay`` (``replay_count``,
``replay_uri``), which train jobs replay, and keeps the rest as the regression suite.

Calibration runs: a loop's first cycle times a shortened train job (run kind
``calibrate``) before its estimate, so the estimate rests on a measurement.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "datasets", sa.Column("replay_count", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("datasets", sa.Column("replay_uri", sa.Text(), nullable=True))
    op.drop_constraint(op.f("ck_dataset_tasks_split"), "dataset_tasks", type_="check")
    op.create_check_constraint(
        op.f("ck_dataset_tasks_split"),
        "dataset_tasks",
        "split IN ('train', 'replay', 'eval', 'heldout', 'regression')",
    )
    op.drop_constraint(op.f("ck_runs_kind"), "runs", type_="check")
    op.create_check_constraint(
        op.f("ck_runs_kind"), "runs", "kind IN ('train', 'eval', 'probe', 'calibrate')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM runs WHERE kind = 'calibrate'")
    op.drop_constraint(op.f("ck_runs_kind"), "runs", type_="check")
    op.create_check_constraint(op.f("ck_runs_kind"), "runs", "kind IN ('train', 'eval', 'probe')")
    op.execute("DELETE FROM dataset_tasks WHERE split = 'replay'")
    op.drop_constraint(op.f("ck_dataset_tasks_split"), "dataset_tasks", type_="check")
    op.create_check_constraint(
        op.f("ck_dataset_tasks_split"),
        "dataset_tasks",
        "split IN ('train', 'eval', 'heldout', 'regression')",
    )
    op.drop_column("datasets", "replay_uri")
    op.drop_column("datasets", "replay_count")
