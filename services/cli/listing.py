"""How the ``list`` commands print a page the api answered: JSON for scripts, else a table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from services.cli.common import print_json

Row = TypeVar("Row", bound=BaseModel)


@dataclass(frozen=True)
class Listing(Generic[Row]):
    """One kind of a loop's rows as ``list`` prints it: the table's header and line for
    people; ``noun`` names the rows when there are none, ``command`` the next page's."""

    noun: str
    command: str
    header: str
    line: Callable[[Row], str]

    def print_page(
        self,
        page: BaseModel,
        rows: Sequence[Row],
        next_cursor: str | None,
        *,
        loop: str,
        as_json: bool,
    ) -> None:
        """The page as the api answered it (JSON), else the table and how to page on."""
        if as_json:
            print_json(page.model_dump(mode="json"))
            return
        if not rows:
            print(f"loop {loop!r} has no {self.noun} yet")
            return
        print(self.header)
        for row in rows:
            print(self.line(row))
        if next_cursor:
            print(f"more: ratchet {self.command} --loop {loop} --cursor {next_cursor}")
