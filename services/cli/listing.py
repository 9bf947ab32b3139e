"""How the ``list`` and ``show`` commands print database rows: JSON for scripts, else text."""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from services.cli.common import database_session, loop_name, loop_named, print_json

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from services.db.models import Loop

Row = TypeVar("Row")


def row_summary(row: object, columns: Sequence[str]) -> dict[str, Any]:
    """The named columns of a database row as scripts read them (times in ISO 8601), in the
    order given, which is also the order ``show`` prints them in."""
    summary = {column: getattr(row, column) for column in columns}
    return {
        key: value.isoformat() if isinstance(value, dt.datetime) else value
        for key, value in summary.items()
    }


@dataclass(frozen=True)
class Listing(Generic[Row]):
    """One kind of a loop's rows as ``list`` prints it: the JSON columns, and the table's
    header and line for people; ``noun`` names the rows when there are none."""

    noun: str
    columns: Sequence[str]
    header: str
    line: Callable[[Row], str]

    def list_for_loop(
        self, args: argparse.Namespace, rows_of: Callable[[Session, Loop], Sequence[Row]]
    ) -> int:
        """A ``list --loop NAME [--json]`` command: the rows ``rows_of`` reads for the loop."""
        with database_session() as session:
            loop = loop_named(session, loop_name(args))
            self.print(
                rows_of(session, loop),
                as_json=args.json,
                empty=f"loop {loop.name!r} has no {self.noun} yet",
            )
        return 0

    def print(self, rows: Sequence[Row], *, as_json: bool, empty: str) -> None:
        """A JSON array for scripts, else the table (and ``empty`` when it has no rows)."""
        if as_json:
            print_json([row_summary(row, self.columns) for row in rows])
            return
        print(self.header)
        for row in rows:
            print(self.line(row))
        if not rows:
            print(empty)
