"""The worker refuses a deploy under a model name another loop serves under on the same
server (issue 43, item 8): the api refuses saving such a loop (tests/services/api/
test_served_names.py); a loop saved before that check must not deploy over the other loop's
model either. Real Postgres; the serving target is a recorder."""

from __future__ import annotations

import pytest
from sqlalchemy import update
from temporalio.exceptions import ApplicationError

from services.db.models import Loop
from services.db.session import SessionFactory
from services.loop.policies import ServingTarget
from tests.workflows.test_loop_activities import RecordingTarget, add_checkpoint, make_loop
from workflows.activities.stages import StageActivities
from workflows.payloads.promote import DeployInput


def test_a_deploy_under_another_loops_name_is_refused(session_factory: SessionFactory) -> None:
    target = RecordingTarget()
    activities = StageActivities.build(session_factory, target)
    loop_id, name = make_loop(session_factory)  # both: the local server, model "ratchet"
    _, other = make_loop(session_factory)
    checkpoint = add_checkpoint(session_factory, loop_id, "c1", 0)

    with pytest.raises(ApplicationError) as raised:
        activities.deploy.deploy_checkpoint(
            DeployInput(name, ServingTarget(), checkpoint, "file:///c1")
        )

    assert raised.value.type == "ServedNameTaken" and raised.value.non_retryable
    assert f"loop {other!r} already serves under the model name 'ratchet'" in str(raised.value)
    assert target.deployed == []

    with session_factory.begin() as session:  # the other loop takes a name of its own
        session.execute(
            update(Loop).where(Loop.name == other).values(serving_target={"model": "other"})
        )
    activities.deploy.deploy_checkpoint(
        DeployInput(name, ServingTarget(), checkpoint, "file:///c1")
    )
    assert target.deployed == [checkpoint]
