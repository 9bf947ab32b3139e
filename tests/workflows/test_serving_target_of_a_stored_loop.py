"""A loop stored with a free-text serving URL (before serving endpoints) keeps running; its
deploys, a rollback included, fail without a request to that URL, not retried, saying what
to configure. The deploy callable is the worker's real one (``ServingTargets``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr
from temporalio.exceptions import ApplicationError

from services.db.models import Loop
from services.db.session import SessionFactory
from services.serving.targets import ServingTargets
from services.settings import Settings
from tests.services.serving.test_targets import Listener
from tests.workflows.test_loop_activities import (
    add_checkpoint,
    add_cycle,
    add_held_promotion,
    loop_row,
    make_loop,
    set_champion,
)
from workflows.activities.stages import StageActivities
from workflows.payloads.loop import LoopConfigInput
from workflows.payloads.promote import DeployInput
from workflows.payloads.rollback import RollbackInput


def test_a_stored_url_loads_and_its_deploys_fail_without_a_request(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    settings = Settings(state_dir=tmp_path, admin_token=SecretStr("admin-token"))
    activities = StageActivities.build(session_factory, ServingTargets(settings))
    loop_id, name = make_loop(session_factory)
    with Listener(200) as listener:
        with session_factory.begin() as session:
            session.get_one(Loop, loop_id).serving_target = {
                "kind": "openai",
                "url": listener.url,
                "model": "agent",
            }
        first = add_checkpoint(session_factory, loop_id, "ckpt-first", 0)
        second = add_checkpoint(session_factory, loop_id, "ckpt-second", 5)
        cycle_id = add_cycle(session_factory, loop_id, 1, champion=first, candidate=second)
        set_champion(session_factory, loop_id, second)
        add_held_promotion(session_factory, cycle_id, candidate=second, previous=first)

        config = activities.cycle.load_loop_config(LoopConfigInput(name))  # the loop keeps running
        assert config.serving_target.retired_keys == ("url",)

        # A failed operator rollback is recorded, the loop runs on (issue 28's rollback item).
        rollback = activities.deploy.rollback_champion(RollbackInput(name, "live complaints"))
        assert not rollback.rolled_back
        assert "RATCHET_SERVING_ENDPOINTS" in rollback.reason
        with pytest.raises(ApplicationError, match="`endpoint`") as refused:
            activities.deploy.deploy_checkpoint(
                DeployInput(name, config.serving_target, second, "file:///c")
            )
        assert refused.value.non_retryable

    assert listener.seen == []
    assert loop_row(session_factory, loop_id).champion_checkpoint_id == second
