"""The ``openai`` serving target against a real ``ratchet serve`` process.

vLLM cannot run here (it needs CUDA): the target is tested against ``ratchet serve`` in a
subprocess, which speaks the same adapter endpoints (``/v1/load_lora_adapter`` with
``load_inplace``, ``/v1/unload_lora_adapter``) and lists models as vLLM does (``root``,
``parent``). The one difference the target relies on is optional: ``ratchet serve`` also
reports the checkpoint id, vLLM does not, so the target falls back to the content-addressed
directory name (tested below with a server whose cards carry no version).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.serving.base import CheckpointRef, DeployFailed, ServingUnavailable
from services.serving.client import ModelCard
from services.serving.openai_target import OpenAIServingTarget, server_path, version_of
from services.settings import ServingEndpoint
from tests.services.modelserver.conftest import ServeProcess, path_of, write_checkpoint


def endpoint(url: str) -> ServingEndpoint:
    """A serving endpoint for the model server at ``url``, as the deployment lists one."""
    return ServingEndpoint(kind="openai", url=url)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> list[CheckpointRef]:
    """Three checkpoints in a content-addressed store (directory name = checkpoint id)."""
    root = tmp_path_factory.mktemp("artifacts") / "checkpoints"
    refs = []
    for seed in range(3):
        scratch = write_checkpoint(root / f"scratch-{seed}", seed)
        final = root / scratch.id
        path_of(scratch).rename(final)
        refs.append(CheckpointRef(id=scratch.id, uri=final.as_uri()))
    return refs


@pytest.fixture
def server(store: list[CheckpointRef], tmp_path: Path) -> Iterator[ServeProcess]:
    process = ServeProcess(path_of(store[0]), name="agent", log=tmp_path / "serve.log")
    yield process
    process.stop()


def models(server: ServeProcess) -> dict[str, dict[str, object]]:
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    return {m["id"]: m for m in data}


def test_deploy_loads_a_versioned_name_moves_the_alias_and_verifies(
    server: ServeProcess, store: list[CheckpointRef]
) -> None:
    beats: list[str] = []
    target = OpenAIServingTarget(endpoint(server.url), model="agent", heartbeat=beats.append)
    current = target.current()
    assert current is not None and current.version == store[0].id

    outcome = target.deploy(store[1])

    assert (outcome.version, outcome.previous_version, outcome.changed) == (
        store[1].id,
        store[0].id,
        True,
    )
    cards = models(server)
    versioned = f"agent-{store[1].id[:12]}"
    assert set(cards) == {"agent", versioned}
    assert cards["agent"]["root"] == cards[versioned]["root"] == str(path_of(store[1]))
    served = target.current()
    assert served is not None and served.version == store[1].id
    assert any("verifying" in beat for beat in beats)

    again = target.deploy(store[1])
    assert again.changed is False

    rolled = target.rollback()
    assert (rolled.version, rolled.previous_version) == (store[0].id, store[1].id)
    assert models(server)["agent"]["root"] == str(path_of(store[0]))
    target.close()


def test_old_versions_are_unloaded_keeping_the_previous_one(
    server: ServeProcess, store: list[CheckpointRef]
) -> None:
    target = OpenAIServingTarget(endpoint(server.url), model="agent")
    for checkpoint in (store[1], store[2], store[0]):
        target.deploy(checkpoint)
    names = set(models(server))
    assert names == {"agent", f"agent-{store[0].id[:12]}", f"agent-{store[2].id[:12]}"}


def test_a_checkpoint_that_is_not_what_it_claims_fails_verification(
    server: ServeProcess, store: list[CheckpointRef]
) -> None:
    target = OpenAIServingTarget(endpoint(server.url), model="agent", verify_timeout_s=1)
    mislabelled = CheckpointRef(id="f" * 64, uri=store[1].uri)
    with pytest.raises(DeployFailed, match=r"not verified: .*serves"):
        target.deploy(mislabelled)
    served = target.current()  # the alias never moved to it
    assert served is not None and served.version == store[0].id


def test_a_refused_load_fails_the_deploy_and_the_alias_keeps_serving(
    server: ServeProcess, store: list[CheckpointRef], tmp_path: Path
) -> None:
    target = OpenAIServingTarget(endpoint(server.url), model="agent")
    missing = CheckpointRef(id="e" * 64, uri=(tmp_path / "missing").as_uri())
    refusal = r"refused POST /v1/load_lora_adapter \(400\)"
    with pytest.raises(DeployFailed, match=refusal) as refused:
        target.deploy(missing)
    assert "missing" not in str(refused.value)  # the server's words are not repeated
    served = target.current()
    assert served is not None and served.version == store[0].id


def test_a_server_that_is_down_is_unavailable(store: list[CheckpointRef]) -> None:
    target = OpenAIServingTarget(endpoint("http://127.0.0.1:9"), model="agent")
    with pytest.raises(ServingUnavailable):
        target.deploy(store[0])


def test_paths_are_rewritten_to_where_the_server_mounts_the_store(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    ref = CheckpointRef(id="a" * 64, uri=(root / "checkpoints" / ("a" * 64)).as_uri())
    assert server_path(ref, root, "/models") == f"/models/checkpoints/{'a' * 64}"
    assert server_path(ref, None, None) == str(root / "checkpoints" / ("a" * 64))
    elsewhere = CheckpointRef(id="b" * 64, uri="file:///elsewhere/ckpt")
    assert server_path(elsewhere, root, "/models") == "/elsewhere/ckpt"


def test_a_version_comes_from_the_server_or_the_content_addressed_root() -> None:
    assert version_of(ModelCard("agent", "/x/" + "c" * 64, None, None)) == "c" * 64
    assert version_of(ModelCard("agent", "/x/ckpt", None, "d" * 64)) == "d" * 64
    assert version_of(ModelCard("agent", "/x/ckpt", None, None)) is None
