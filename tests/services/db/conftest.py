"""The dashboard's realistic loop history, seeded into a fresh database per test, for the
read models of services.db.queries."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select

from services.db.models import Loop
from services.db.session import SessionFactory
from tests.services.dashboard.seed import Story, seed_story


@dataclass(frozen=True)
class Seeded:
    story: Story
    sessions: SessionFactory
    loop_id: int
    quiet_loop_id: int


@pytest.fixture
def seeded(session_factory: SessionFactory, tmp_path: Path) -> Seeded:
    with session_factory.begin() as session:
        story = seed_story(session, now=dt.datetime.now(dt.UTC), artifacts_dir=tmp_path)
    with session_factory() as session:
        ids = {name: loop_id for name, loop_id in session.execute(select(Loop.name, Loop.id))}
    return Seeded(story, session_factory, ids[story.loop], ids[story.quiet_loop])
