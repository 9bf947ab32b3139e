"""One lookup of a loop by name, one error when it is missing; sessions by keyword."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.db.queries.errors import NotFound
from services.db.queries.loops import LoopFields, create_loop, require_loop
from services.db.session import SessionFactory

QUERIES = Path(__file__).parents[3] / "services" / "db" / "queries"


def test_require_loop_finds_the_loop_or_raises_not_found(session_factory: SessionFactory) -> None:
    with session_factory.begin() as session:
        created = create_loop(
            session=session, fields=LoopFields(name="found", environment="toolcalc")
        )
    with session_factory.begin() as session:
        assert require_loop(session=session, name="found").id == created.id
        assert require_loop(session=session, name="found", for_update=True).id == created.id
        with pytest.raises(NotFound, match="loop 'missing' does not exist"):
            require_loop(session=session, name="missing")


def test_every_query_function_takes_the_session_keyword_only() -> None:
    """STYLE habit 9, for every public function of ``services/db/queries``."""
    positional = []
    modules = sorted(QUERIES.glob("*.py"))
    assert len(modules) > 5
    for path in modules:
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            names = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
            if "session" in names:
                positional.append(f"{path.name}:{node.name}")
    assert positional == []
