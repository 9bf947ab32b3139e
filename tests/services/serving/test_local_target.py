"""The local serving target against a real model server: deploy, verify, roll back."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from services.serving.model import ModelSlot, SwapReport, load_model

from services.serving.base import CheckpointRef, DeployFailed, ServingUnavailable
from services.serving.local import LocalServerProcess, LocalServingTarget
from tests.services.serving.conftest import ServerThread


def test_deploy_swaps_and_verifies_the_served_version(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    target = LocalServingTarget(server.url)

    current = target.current()
    assert current is not None and current.version == checkpoints[0].id
    outcome = target.deploy(checkpoints[1])
    assert (outcome.version, outcome.previous_version, outcome.changed) == (
        checkpoints[1].id,
        checkpoints[0].id,
        True,
    )
    assert outcome.latency_ms > 0
    again = target.deploy(checkpoints[1])
    assert again.changed is False
    rolled = target.rollback()
    assert rolled.version == checkpoints[0].id
    assert target.current() == target.current()
    served = target.current()
    assert served is not None and served.version == checkpoints[0].id
    assert target.stats()["model_version"] == checkpoints[0].id
    target.close()


def test_a_refused_checkpoint_fails_the_deploy(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    server = serve(checkpoints[0])
    target = LocalServingTarget(server.url)
    mislabelled = CheckpointRef(id=checkpoints[2].id, uri=checkpoints[1].uri)
    with pytest.raises(DeployFailed, match="not the expected"):
        target.deploy(mislabelled)
    served = target.current()
    assert served is not None and served.version == checkpoints[0].id


class SwapThatDoesNothing(ModelSlot):
    """A server bug: the swap answers ok but the old model keeps serving."""

    def swap(self, path: Path, *, expected_version: str | None = None) -> SwapReport:
        return SwapReport(expected_version or "", self.current.version, True, 0.0)


def test_the_target_does_not_trust_a_successful_swap(
    serve: Callable[..., ServerThread], checkpoints: list[CheckpointRef]
) -> None:
    path = Path(checkpoints[0].uri.removeprefix("file://"))
    server = serve(checkpoints[0], slot=SwapThatDoesNothing(load_model(path)))
    target = LocalServingTarget(server.url)
    with pytest.raises(DeployFailed, match="deploy not verified"):
        target.deploy(checkpoints[1])


def test_an_absent_server_is_unavailable_without_a_launcher(
    checkpoints: list[CheckpointRef],
) -> None:
    target = LocalServingTarget("http://127.0.0.1:9")
    with pytest.raises(ServingUnavailable):
        target.deploy(checkpoints[0])


def test_the_first_deploy_starts_a_model_server(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = LocalServerProcess(
        host="127.0.0.1", port=port, logs_dir=tmp_path / "logs", device="cpu"
    )
    target = LocalServingTarget(f"http://127.0.0.1:{port}", process=process)
    try:
        assert target.current() is None
        started = target.deploy(checkpoints[0])
        assert (started.version, started.previous_version) == (checkpoints[0].id, None)
        swapped = target.deploy(checkpoints[1])
        assert swapped.previous_version == checkpoints[0].id
    finally:
        process.stop()
        target.close()
    assert (tmp_path / "logs" / "serve.log").exists()


def test_a_server_that_cannot_start_fails_the_deploy(
    checkpoints: list[CheckpointRef], tmp_path: Path
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = LocalServerProcess(host="127.0.0.1", port=port, logs_dir=tmp_path / "logs")
    target = LocalServingTarget(f"http://127.0.0.1:{port}", process=process)
    missing = CheckpointRef(id="0" * 64, uri=(tmp_path / "missing").as_uri())
    with pytest.raises(DeployFailed, match="exited with code 2"):
        target.deploy(missing)
    assert "does not exist" in (tmp_path / "logs" / "serve.log").read_text()
