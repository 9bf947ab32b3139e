"""The serving-target recipe: a second kind, registered by a test, is one module (here, the
target class and its builder below) plus one registry entry, and a loop that names it
deploys through the same path as every loop: the stored row, the loop's configuration, the
deploy activity and the worker's ``ServingTargets``, with no branch for the kind anywhere.

The test kind is a real, small target: it serves by writing which checkpoint is served to
a pointer file (as a symlink-swapping deploy would) and verifies by reading the file back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from services.db.models import Loop
from services.db.session import SessionFactory
from services.loop.policies import ServingTarget as ServingConfig
from services.loop.policies import serving_endpoint_problem
from services.serving.base import (
    BuildContext,
    CheckpointRef,
    DeployFailed,
    DeployOutcome,
    ServedVersion,
)
from services.serving.kinds import TARGET_KINDS, TargetKind, register
from services.serving.targets import ServingTargets
from services.settings import Settings
from tests.workflows.test_loop_activities import add_checkpoint, make_loop
from workflows.activities.stages import StageActivities
from workflows.payloads.loop import LoopConfigInput
from workflows.payloads.promote import DeployInput

KIND = "pointer-file"


class PointerFileTarget:
    """Serves the checkpoint a JSON pointer file names; the file is the whole server."""

    kind = KIND

    def __init__(self, path: Path) -> None:
        self.path = path

    def current(self) -> ServedVersion | None:
        if not self.path.exists():
            return None
        data = json.loads(self.path.read_text())
        return ServedVersion(data["version"], data["uri"], data.get("previous"))

    def deploy(self, checkpoint: CheckpointRef) -> DeployOutcome:
        started = time.perf_counter()
        served = self.current()
        if served is not None and served.version == checkpoint.id:
            return DeployOutcome(checkpoint.id, served.previous_version, 0.0, changed=False)
        previous = served.version if served else None
        previous_uri = served.uri if served else None
        self._write(checkpoint.id, checkpoint.uri, previous, previous_uri)
        return self._verified(checkpoint.id, previous, started)

    def rollback(self) -> DeployOutcome:
        started = time.perf_counter()
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        if not data.get("previous"):
            raise DeployFailed("nothing was served before: no version to roll back to")
        self._write(data["previous"], data["previous_uri"], data["version"], data["uri"])
        return self._verified(data["previous"], data["version"], started)

    def stats(self) -> dict[str, Any]:
        return {"pointer": str(self.path)}

    def _write(self, version: str, uri: str, previous: str | None, prev_uri: str | None) -> None:
        record = {"version": version, "uri": uri, "previous": previous, "previous_uri": prev_uri}
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, self.path)  # readers see the old pointer or the new one

    def _verified(self, version: str, previous: str | None, started: float) -> DeployOutcome:
        served = self.current()  # never the deploy's own word
        if served is None or served.version != version:
            raise DeployFailed(f"the pointer names {served and served.version!r}, not {version}")
        return DeployOutcome(version, previous, (time.perf_counter() - started) * 1000.0)


def build_pointer_file(config: ServingConfig, context: BuildContext) -> PointerFileTarget:
    """The kind's builder: the pointer file named by the loop's ``model``, under the state
    directory."""
    assert config.model is not None  # the kind needs it
    return PointerFileTarget(context.settings.state_dir / f"{config.model}.pointer.json")


@pytest.fixture
def pointer_kind() -> Iterator[TargetKind]:
    kind = register(TargetKind(KIND, build_pointer_file, needs_model=True))
    yield kind
    TARGET_KINDS.pop(KIND)


def test_a_registered_kind_is_a_loop_configuration_with_its_own_rules(
    pointer_kind: TargetKind,
) -> None:
    config = ServingConfig.model_validate({"kind": KIND, "model": "champion"})
    assert config.kind == KIND
    assert serving_endpoint_problem(config, {}) == ""  # it deploys to no endpoint
    with pytest.raises(ValidationError, match="pointer-file serving target needs `model`"):
        ServingConfig.model_validate({"kind": KIND})
    with pytest.raises(ValidationError, match="takes no `endpoint`"):
        ServingConfig.model_validate({"kind": KIND, "model": "m", "endpoint": "vllm"})
    with pytest.raises(ValidationError, match=r"expected one of local, .*pointer-file") as bad:
        ServingConfig.model_validate({"kind": "ssh"})
    assert bad.value.errors()[0]["loc"] == ("kind",)


def test_a_kind_is_registered_once(pointer_kind: TargetKind) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register(TargetKind(KIND, build_pointer_file))


def test_a_loop_naming_the_new_kind_deploys_through_the_loops_own_path(
    pointer_kind: TargetKind, session_factory: SessionFactory, tmp_path: Path
) -> None:
    settings = Settings(state_dir=tmp_path, admin_token=SecretStr("admin-token"))
    targets = ServingTargets(settings)
    activities = StageActivities.build(session_factory, targets)
    loop_id, name = make_loop(session_factory)
    with session_factory.begin() as session:
        session.get_one(Loop, loop_id).serving_target = {"kind": KIND, "model": "champion"}
    first = add_checkpoint(session_factory, loop_id, "ckpt-first", 0)
    second = add_checkpoint(session_factory, loop_id, "ckpt-second", 5)

    config = activities.cycle.load_loop_config(LoopConfigInput(name))
    assert config.serving_target.kind == KIND
    serving_target = config.serving_target.model_dump()
    for checkpoint in (first, second):
        deployed = activities.deploy.deploy_checkpoint(
            DeployInput(name, config.serving_target, checkpoint, f"file:///artifacts/{checkpoint}")
        )
        assert deployed.served_version == checkpoint
        assert deployed.delivery.startswith("not verified")  # no probe set was recorded

    pointer = json.loads((tmp_path / "champion.pointer.json").read_text())
    assert (pointer["version"], pointer["previous"]) == (second, first)
    target = targets.target(serving_target)
    assert isinstance(target, PointerFileTarget)  # one target per configuration, reused
    assert target.rollback().version == first
    assert targets.usage(serving_target) == {}  # no model server: nothing to sample
    assert targets.attestation(serving_target) is None
