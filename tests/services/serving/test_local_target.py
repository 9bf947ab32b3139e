"""The local serving target: ``ratchet serve`` on this machine, started on the first deploy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.serving.base import CheckpointRef, DeployFailed, ServingUnavailable
from services.serving.local import LocalServerProcess, LocalServingTarget
from tests.services.modelserver.conftest import ServerThread, free_port


def test_deploy_and_rollback_on_a_running_server(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    target = LocalServingTarget(server.url)
    outcome = target.deploy(checkpoints[1])
    assert (outcome.version, outcome.previous_version) == (checkpoints[1].id, checkpoints[0].id)
    assert target.rollback().version == checkpoints[0].id
    assert {m.name for m in server.registry.names()} >= {"ratchet"}
    target.close()


def test_an_absent_server_is_unavailable_without_a_launcher(
    checkpoints: list[CheckpointRef],
) -> None:
    target = LocalServingTarget("http://127.0.0.1:9")
    with pytest.raises(ServingUnavailable):
        target.deploy(checkpoints[0])


def test_the_first_deploy_starts_a_model_server(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    port = free_port()
    process = LocalServerProcess(
        host="127.0.0.1", port=port, logs_dir=tmp_path / "logs", device="cpu"
    )
    target = LocalServingTarget(f"http://127.0.0.1:{port}", model="agent", process=process)
    try:
        assert "--threads" in process.command(Path("/c"), "agent")  # one core for serving
        started = target.deploy(checkpoints[0])
        assert (started.version, started.previous_version) == (checkpoints[0].id, None)
        swapped = target.deploy(checkpoints[1])
        assert swapped.previous_version == checkpoints[0].id
        served = target.current()
        assert served is not None and served.version == checkpoints[1].id
    finally:
        process.stop()
        target.close()
    assert (tmp_path / "logs" / "serve.log").exists()


def test_a_server_that_cannot_start_fails_the_deploy(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    port = free_port()
    process = LocalServerProcess(host="127.0.0.1", port=port, logs_dir=tmp_path / "logs")
    target = LocalServingTarget(f"http://127.0.0.1:{port}", process=process)
    missing = CheckpointRef(id="0" * 64, uri=(tmp_path / "missing").as_uri())
    with pytest.raises(DeployFailed, match="exited with code 2"):
        target.deploy(missing)
    assert "does not exist" in (tmp_path / "logs" / "serve.log").read_text()
