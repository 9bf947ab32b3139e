"""How the ``list`` and ``show`` commands print database rows: JSON for scripts, else text."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.cli.common import print_json

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
    """One kind of row as ``list`` prints it: the JSON columns, and the table's header and
    line for people."""

    columns: Sequence[str]
    header: str
    line: Callable[[Row], str]

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
