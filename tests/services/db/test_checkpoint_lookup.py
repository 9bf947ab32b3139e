"""One contract per checkpoint lookup: ``get_checkpoint`` answers None for a checkpoint that
is not registered, ``require_checkpoint`` raises :class:`NotFound`."""

from __future__ import annotations

import pytest

from services.db.queries.errors import NotFound
from services.db.queries.loops import LoopFields, create_loop
from services.db.queries.runs import (
    NewCheckpoint,
    get_checkpoint,
    require_checkpoint,
    upsert_checkpoint,
)
from services.db.session import SessionFactory


def test_get_checkpoint_answers_none_and_require_checkpoint_raises_not_found(
    session_factory: SessionFactory,
) -> None:
    with session_factory.begin() as session:
        loop = create_loop(session=session, fields=LoopFields(name="ckpt", environment="toolcalc"))
        upsert_checkpoint(
            session=session,
            checkpoint=NewCheckpoint(
                checkpoint_id="c" * 64,
                loop_id=loop.id,
                uri="file:///artifacts/c",
                fmt="tiny",
                size_bytes=1,
                sha256="c" * 64,
                manifest={},
            ),
        )
    with session_factory.begin() as session:
        found = get_checkpoint(session=session, checkpoint_id="c" * 64)
        assert found is not None
        assert require_checkpoint(session=session, checkpoint_id="c" * 64).id == found.id
        assert get_checkpoint(session=session, checkpoint_id="missing") is None
        with pytest.raises(NotFound, match="checkpoint 'missing' does not exist"):
            require_checkpoint(session=session, checkpoint_id="missing")
