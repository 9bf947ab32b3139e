"""The serving-target recipe: a second kind, registered by a test, is one module (here, the
target class and its builder below) plus one registry entry, and a loop that names it
deploys through the same path as every loop: the stored row, the loop's configuration, the
deploy activity and the worker's ``ServingTargets``, with no branch for the kind anywhere.

The test kind is a real, small target: it serves by writing which checkpoint is served to
a pointer file (as a symlink-swapping deploy would) and verifies by reading the file back.
A second entry deploys the same target to one of the operator's serving endpoints: the
entry's endpoint rule is all it takes for ``RATCHET_SERVING_ENDPOINTS`` to accept the kind,
with no edit to the settings.
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

from services.api.app import create_app
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
from services.serving.kinds import TARGET_KINDS, TargetKind, check_serving_endpoints, register
from services.serving.targets import ServingTargets
from services.settings import ServingEndpoint, Settings, SettingsError, load_settings
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


def build_pointer_server(config: ServingConfig, context: BuildContext) -> PointerFileTarget:
    """An endpoint kind's builder: the pointer file in the endpoint's ``artifacts_dir`` (the
    operator's setting, as a URL or a Deployment is for the built-in endpoint kinds)."""
    assert context.endpoint is not None and context.endpoint.artifacts_dir is not None
    return PointerFileTarget(Path(context.endpoint.artifacts_dir) / "served.pointer.json")


# A second kind that deploys to a serving endpoint: its entry carries its endpoint rule.
POINTER_SERVER = TargetKind(
    "pointer-server",
    build_pointer_server,
    needs_endpoint=True,
    endpoint_requires=("artifacts_dir",),
    endpoint_refuses=("namespace", "deployment", "container"),
    description="a pointer file in the endpoint's artifact directory",
)
KIND_OF_SERVER = POINTER_SERVER.name


@pytest.fixture
def pointer_server_kind() -> Iterator[TargetKind]:
    kind = register(POINTER_SERVER)
    yield kind
    TARGET_KINDS.pop(kind.name)


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


def test_a_registered_endpoint_kind_needs_no_edit_to_settings(
    pointer_server_kind: TargetKind, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The endpoint parses from RATCHET_SERVING_ENDPOINTS, passes the api's and the
    worker's start check, a loop naming it validates and deploys, and the OpenAPI publishes
    the kind's branch: settings never heard of the kind."""
    endpoints = {"files": {"kind": "pointer-server", "url": "http://files:8000"}}
    endpoints["files"]["artifacts_dir"] = str(tmp_path)
    monkeypatch.setenv("RATCHET_SERVING_ENDPOINTS", json.dumps(endpoints))
    settings = load_settings(state_dir=tmp_path / "state")
    assert settings.serving_endpoints["files"].kind == "pointer-server"
    check_serving_endpoints(settings.serving_endpoints)

    config = ServingConfig.model_validate({"kind": "pointer-server", "endpoint": "files"})
    assert serving_endpoint_problem(config, settings.serving_endpoints) == ""
    targets = ServingTargets(settings)
    assert targets(config.model_dump(), "ckpt-1", "file:///store/ckpt-1") == "ckpt-1"
    assert json.loads((tmp_path / "served.pointer.json").read_text())["version"] == "ckpt-1"

    schema = create_app(settings).openapi()["components"]["schemas"]["ServingTarget"]
    (branch,) = [b for b in schema["oneOf"] if b["properties"]["kind"]["const"] == KIND_OF_SERVER]
    assert branch["required"] == ["kind", "endpoint"]
    assert branch["description"] == POINTER_SERVER.description
    assert KIND_OF_SERVER in schema["properties"]["kind"]["enum"]


def test_a_registered_endpoint_kinds_rule_is_its_entrys(pointer_server_kind: TargetKind) -> None:
    bare = ServingEndpoint(kind=KIND_OF_SERVER, url="http://files")
    with pytest.raises(SettingsError) as refused:
        check_serving_endpoints({"files": bare})
    assert str(refused.value) == (
        "invalid setting RATCHET_SERVING_ENDPOINTS (files.artifacts_dir): a pointer-server "
        "serving endpoint needs `artifacts_dir`"
    )
    named = bare.model_copy(update={"artifacts_dir": "/srv", "deployment": "d"})
    with pytest.raises(SettingsError, match=r"\(files\.deployment\): .* takes no `deployment`"):
        check_serving_endpoints({"files": named})
    # a loop naming it is told the same when it is saved or deployed
    config = ServingConfig(kind=KIND_OF_SERVER, endpoint="files")
    assert "needs `artifacts_dir`" in serving_endpoint_problem(config, {"files": bare})
    # and a loop naming it must name an endpoint, as for every endpoint kind
    with pytest.raises(ValidationError, match="pointer-server serving target needs `endpoint`"):
        ServingConfig.model_validate({"kind": KIND_OF_SERVER})


def test_an_entrys_endpoint_rule_must_name_endpoint_fields() -> None:
    with pytest.raises(ValueError, match="no serving endpoint field deploymnet"):
        register(TargetKind("typo", None, needs_endpoint=True, endpoint_requires=("deploymnet",)))
    with pytest.raises(ValueError, match="endpoint rules but no endpoint"):
        register(TargetKind("typo", None, endpoint_refuses=("deployment",)))
    with pytest.raises(ValueError, match="must match"):
        register(TargetKind("Not A Name", None))
    assert "typo" not in TARGET_KINDS
