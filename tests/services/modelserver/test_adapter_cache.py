"""Many adapters on one base (one loop per agent): at most ``max_resident_adapters`` stay
loaded, the least recently requested one that no request holds is unloaded, its name stays
registered, and a request for it loads it again on demand and is answered as if it had
never left. A tiny random Llama and LoRA adapters built in the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.modelserver.registry import LoadRefused, ModelRegistry
from services.serving.base import CheckpointRef
from tests.services.modelserver.conftest import ServerThread, path_of
from tests.services.modelserver.test_hot_swap import greedy, load

Serve = Callable[..., ServerThread]


@pytest.fixture(scope="module")
def four_adapters(tmp_path_factory: pytest.TempPathFactory) -> list[CheckpointRef]:
    """A tiny Llama and four LoRA adapters on it, each changing the greedy answer."""
    from tests.services.modelserver.hf_models import write_lora_adapter, write_tiny_llama

    root = tmp_path_factory.mktemp("adapters")
    base = write_tiny_llama(root / "base")
    return [base, *(write_lora_adapter(base, root / f"a{i}", i) for i in range(1, 5))]


def capped(base: CheckpointRef, cap: int) -> ModelRegistry:
    registry = ModelRegistry(device="cpu", max_resident_adapters=cap)
    registry.load("base", path_of(base))
    return registry


def resident_names(registry: ModelRegistry) -> set[str]:
    return {
        m.name
        for m in registry.names()
        if m.adapter is not None and m.adapter in m.engine.adapters()
    }


def test_past_the_cap_the_least_recently_requested_adapter_goes_cold(
    four_adapters: list[CheckpointRef],
) -> None:
    base, a1, a2, a3, _ = four_adapters
    registry = capped(base, 2)
    for name, adapter in (("a1", a1), ("a2", a2), ("a3", a3)):
        registry.load(name, path_of(adapter))
    assert {m.name for m in registry.names()} == {"base", "a1", "a2", "a3"}  # all registered
    assert resident_names(registry) == {"a2", "a3"}  # a1 was asked for least recently
    assert registry.resident_adapters() == 2

    held = registry.acquire("a1")  # cold: loaded again, and a2 (least recent) makes room
    assert held.version == a1.id
    assert resident_names(registry) == {"a1", "a3"}
    assert (registry.cold_loads, registry.evictions) == (1, 2)
    registry.release(held)
    registry.release(registry.acquire("a3"))
    registry.release(registry.acquire("a2"))  # a1 is now the least recent: it goes
    assert resident_names(registry) == {"a2", "a3"}


def test_an_adapter_a_request_holds_is_never_unloaded(
    four_adapters: list[CheckpointRef],
) -> None:
    base, a1, a2, a3, _ = four_adapters
    registry = capped(base, 1)
    registry.load("a1", path_of(a1))
    held = registry.acquire("a1")
    registry.load("a2", path_of(a2))
    registry.load("a3", path_of(a3))
    # a1 answers a request: it stays (the cap is passed meanwhile), the idle ones go.
    assert "a1" in resident_names(registry)
    assert held.adapter in held.engine.adapters()
    registry.release(held)
    assert len(resident_names(registry)) == 1


def test_a_cold_adapter_whose_checkpoint_changed_is_refused(
    four_adapters: list[CheckpointRef], tmp_path: Path
) -> None:
    import shutil

    base, a1, a2, _, _ = four_adapters
    copy = tmp_path / "a1-copy"
    shutil.copytree(path_of(a1), copy)
    registry = capped(base, 1)
    registry.load("a1", copy)
    registry.load("a2", path_of(a2))  # a1 goes cold
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # tampered while cold
    with pytest.raises(LoadRefused):
        registry.acquire("a1")
    assert "a2" in resident_names(registry)  # nothing else changed


def test_over_http_every_registered_adapter_answers_as_if_always_loaded(
    serve: Serve, four_adapters: list[CheckpointRef]
) -> None:
    base, *adapters = four_adapters
    names = [f"agent-{i}" for i in range(1, 5)]
    everything = serve(base, name="base")  # no cap: every adapter stays loaded
    small = serve(base, name="base", registry=capped(base, 2))
    for name, adapter in zip(names, adapters, strict=True):
        assert load(everything, name, adapter).status_code == 200
        assert load(small, name, adapter).status_code == 200
    expected = {name: greedy(everything, name) for name in names}
    for _ in range(2):  # every request of the second round finds its adapter cold again
        for name in names:
            assert greedy(small, name) == expected[name]
    stats = httpx.get(f"{small.url}/v1/stats").json()
    assert stats["resident_adapters"] == 2
    assert stats["cold_adapter_loads"] >= 6
    cards = {m["id"] for m in httpx.get(f"{small.url}/v1/models").json()["data"]}
    assert cards == {"base", *names}
