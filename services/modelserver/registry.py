"""The served models by name: full models and LoRA adapters, loaded and swapped without a gap.

A *served name* (what a client puts in ``model``) points at an engine and, for an adapter,
at one of the adapters resident on that engine's base. Loading a checkpoint under a name
loads and verifies it beside whatever serves now (requests keep being answered meanwhile)
and then switches the name in one assignment. A request resolves its name once, when it
arrives, and holds that model to its end: a swap never changes a model under a request and
never fails one. What nothing points at any more (no name, no request in flight) is freed.

Names that point at the same checkpoint share it: loading ``agent`` and ``agent-<id>`` from
one directory keeps one copy, which is what makes "load the candidate under its versioned
name, then move the alias to it" cost one load.

Many loops over one base model register many adapters, most of them asked for rarely. With
``max_resident_adapters`` (``RATCHET_SERVE_MAX_ADAPTERS``, vLLM's ``--max-cpu-loras``) at
most that many adapters stay loaded: past it, the least recently requested adapter that no
request holds is unloaded, and its names stay registered, cold. A request for a cold name
loads its adapter again on demand, from the checkpoint directory it was registered from,
verified as on the first load (a checkpoint that changed meanwhile is refused, never served
under the old version's name), and another cold one makes room.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from services.artifacts import uri_to_path
from services.inference.engine import Engine
from services.inference.hf import HFEngine, verify_hf
from services.inference.tiny import TinyEngine
from services.training.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    Manifest,
    open_regular_file,
    read_manifest,
    verify_checkpoint,
)
from services.training.hf.checkpoint import resolve_base_dir

logger = logging.getLogger(__name__)


class LoadRefused(Exception):
    """A checkpoint that cannot be served (missing, tampered, wrong base...): nothing changed."""


class ModelNotFound(LookupError):
    """No model is served under that name."""


class AdapterCold(LookupError):
    """The name's adapter is registered but not loaded: :meth:`ModelRegistry.acquire` with
    ``load=True`` (off the event loop) loads it."""


@dataclass(frozen=True)
class ServedModel:
    """What one served name answers with."""

    name: str
    engine: Engine
    adapter: str | None  # the engine's internal adapter key; None for the full model
    version: str  # checkpoint id of the weights that answer
    root: str  # the checkpoint directory as it was given
    parent: str | None  # for an adapter: the version of its base model
    created: int


def manifest_of(path: Path) -> Manifest:
    """The checkpoint's manifest (unverified: loading verifies); :class:`LoadRefused` if none."""
    if not path.is_dir():
        raise LoadRefused(f"checkpoint directory {path} does not exist")
    try:
        return read_manifest(path)
    except CheckpointError as exc:
        raise LoadRefused(str(exc)) from exc


@contextmanager
def verified_copy(path: Path) -> Iterator[Path]:
    """A private copy of exactly the files ``path``'s manifest lists, verified, for loading.

    What is served is what the manifest lists: loaders (``from_pretrained`` above all) read
    whatever a directory holds and follow symlinks, so an unlisted ``chat_template.jinja``
    or a ``tokenizer_config.json -> /etc/hostname`` would change the served prompt while the
    checkpoint verifies and keeps its id. The copy holds only the listed files, each read as
    a regular file (never through a symlink), and is verified after copying, so nothing can
    change between the check and the load either. It is removed once loaded (the weights are
    in memory by then)."""
    manifest = manifest_of(path)
    with tempfile.TemporaryDirectory(prefix="ratchet-serve-") as scratch:
        copy = Path(scratch)
        for name in (*manifest.files, MANIFEST_FILE):
            if Path(name).name != name or name in (".", ".."):
                raise LoadRefused(f"manifest of {path} lists {name!r}, which is not a file name")
            try:
                source = os.fdopen(open_regular_file(path / name), "rb")
            except CheckpointError as exc:
                raise LoadRefused(str(exc)) from exc
            with source, (copy / name).open("xb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
        try:
            verify_checkpoint(copy, expected_id=manifest.checkpoint_id)
        except CheckpointError as exc:
            raise LoadRefused(str(exc).replace(str(copy), str(path))) from exc
        yield copy


def load_engine(path: Path, *, device: str) -> Engine:
    """A full model checkpoint of either family, loaded from its :func:`verified_copy`;
    :class:`LoadRefused` if it cannot be served."""
    with verified_copy(path) as copy:
        manifest = read_manifest(copy)
        try:
            engine: HFEngine | TinyEngine
            if manifest.family == "hf":
                engine = HFEngine.load(copy, device=device)
            else:
                engine = TinyEngine.load(copy, device=device)
        except CheckpointError as exc:
            raise LoadRefused(str(exc).replace(str(copy), str(path))) from exc
    engine.path = str(path)
    return engine


def checkpoint_dir_within(raw: str, roots: Sequence[Path]) -> Path:
    """The checkpoint directory ``raw`` names, if a client may load it; :class:`LoadRefused`
    otherwise, with one message whatever the reason (outside the roots, missing, a symlink,
    not a checkpoint), so the answer tells nothing about what exists on this machine.

    ``raw`` must be absolute (a path or ``file://`` URI), without ``..``, inside one of
    ``roots``, and no component below the root may be a symlink."""
    refused = LoadRefused(
        f"{raw!r} is not a checkpoint directory this server loads from: lora_path must be an "
        "absolute path to a checkpoint inside the server's model roots "
        "(RATCHET_SERVE_MODEL_ROOTS), with no symlinks"
    )
    try:
        candidate = uri_to_path(raw)
    except ValueError:
        raise refused from None
    if not candidate.is_absolute() or ".." in candidate.parts or "\x00" in raw:
        raise refused
    for root in roots:
        resolved_root = root.resolve()
        for base in dict.fromkeys((root, resolved_root)):
            try:
                rest = candidate.relative_to(base)
            except ValueError:
                continue
            return _plain_directory(resolved_root, rest.parts, refused)
    raise refused


def _plain_directory(root: Path, parts: tuple[str, ...], refused: LoadRefused) -> Path:
    """``root``/``parts`` if every step is a real directory (no symlink) holding a manifest."""
    current = root
    try:
        for part in parts:
            current = current / part
            if not stat.S_ISDIR(current.lstat().st_mode):
                raise refused
        if not stat.S_ISREG((current / MANIFEST_FILE).lstat().st_mode):
            raise refused
    except (OSError, ValueError):  # ValueError: a name the filesystem cannot encode
        raise refused from None
    return current


class ModelRegistry:
    """Served names → models. Safe to use from many threads."""

    def __init__(self, *, device: str = "auto", max_resident_adapters: int | None = None) -> None:
        if max_resident_adapters is not None and max_resident_adapters < 1:
            raise ValueError("max_resident_adapters must be at least 1 (None: no limit)")
        self._device = device
        self._max_resident = max_resident_adapters
        # When each loaded adapter, (engine id, key), was last asked for (a tick, not a time).
        self._last_used: dict[tuple[int, str], int] = {}
        self._ticks = itertools.count()
        # Adapters being unloaded to make room: a request for them loads them again instead.
        self._evicting: set[tuple[int, str]] = set()
        self.cold_loads = 0  # adapters loaded again on demand
        self.evictions = 0  # adapters unloaded to make room
        self._names: dict[str, ServedModel] = {}
        self._in_flight: dict[int, tuple[ServedModel, int]] = {}  # id -> (model, requests)
        self._lock = threading.Lock()  # guards the maps; held only for assignments
        self._load_lock = threading.Lock()  # one load at a time (they are memory-heavy)
        self._keys = itertools.count(1)
        # Adapters loaded onto an engine whose name has not switched to them yet: in use, so
        # a collection that runs meanwhile (a request's release) must not unload them.
        self._loading: set[tuple[int, str]] = set()
        self.swaps = 0

    # Reading -----------------------------------------------------------------------------

    def names(self) -> list[ServedModel]:
        with self._lock:
            return list(self._names.values())

    def acquire(self, name: str, *, load: bool = True) -> ServedModel:
        """The model serving ``name`` now, held until :meth:`release`.

        A cold adapter (unloaded to make room) is loaded again first, which blocks: with
        ``load=False`` it raises :class:`AdapterCold` instead (the event loop's fast path)."""
        with self._lock:
            served = self._names.get(name)
            if served is None:
                raise ModelNotFound(name)
            if self._resident(served):
                return self._hold(served)
        if not load:
            raise AdapterCold(name)
        return self._load_cold(name)

    def resident_adapters(self) -> int:
        """Adapters loaded now, on every engine."""
        with self._lock:
            engines = {id(m.engine): m.engine for m in self._names.values()}
        return sum(len(e.adapters()) for e in engines.values() if isinstance(e, HFEngine))

    def _resident(self, served: ServedModel) -> bool:
        """Whether ``served``'s weights are loaded (a full model always is). Under the lock."""
        if served.adapter is None:
            return True
        key = (id(served.engine), served.adapter)
        return key not in self._evicting and served.adapter in served.engine.adapters()

    def _hold(self, served: ServedModel) -> ServedModel:
        """Count a request on ``served`` and mark its adapter used. Under the lock."""
        _, count = self._in_flight.get(id(served), (served, 0))
        self._in_flight[id(served)] = (served, count + 1)
        if served.adapter is not None:
            self._last_used[(id(served.engine), served.adapter)] = next(self._ticks)
        return served

    def release(self, served: ServedModel) -> None:
        with self._lock:
            _, count = self._in_flight.get(id(served), (served, 1))
            if count > 1:
                self._in_flight[id(served)] = (served, count - 1)
                return
            self._in_flight.pop(id(served), None)
        self._collect()
        # Room that requests held is made now, unless a load (which makes it too) runs.
        if self._load_lock.acquire(blocking=False):
            try:
                self._evict()
            finally:
                self._load_lock.release()

    # Loading -----------------------------------------------------------------------------

    def load(self, name: str, path: Path, *, replace: bool = False) -> ServedModel:
        """Serve the checkpoint at ``path`` as ``name``; ``replace`` swaps an existing name."""
        with self._load_lock:
            with self._lock:
                exists = name in self._names
            if exists and not replace:
                raise LoadRefused(
                    f"a model named {name!r} is already loaded; pass load_inplace=true to swap it"
                )
            served = self._prepare(name, path)
            with self._lock:
                previous = self._names.get(name)
                self._names[name] = served  # the switch
                if served.adapter is not None:
                    self._loading.discard((id(served.engine), served.adapter))
                    self._last_used[(id(served.engine), served.adapter)] = next(self._ticks)
                if previous is not None:
                    self.swaps += 1
            self._evict()
        if previous is not None:
            logger.info(
                "%s now serves %s (was %s)", name, served.version[:12], previous.version[:12]
            )
            self._collect()
        else:
            logger.info("%s serves %s from %s", name, served.version[:12], path)
        return served

    def unload(self, name: str) -> ServedModel:
        with self._lock:
            served = self._names.get(name)
            if served is None:
                raise ModelNotFound(name)
            dependents = sorted(
                other.name
                for other in self._names.values()
                if other.adapter is not None
                and other.engine is served.engine
                and served.adapter is None
                and other.name != name
            )
            sharing = any(
                other.engine is served.engine and other.adapter is None and other.name != name
                for other in self._names.values()
            )
            if dependents and not sharing:
                raise LoadRefused(
                    f"adapters {', '.join(dependents)} run on {name!r}; unload them first"
                )
            del self._names[name]
        self._collect()
        return served

    # Cold adapters ------------------------------------------------------------------------

    def _load_cold(self, name: str) -> ServedModel:
        """Load ``name``'s adapter again (it was unloaded to make room) and hold it; every
        name that shared the old load shares the new one."""
        with self._load_lock:
            with self._lock:
                served = self._names.get(name)
                if served is None:
                    raise ModelNotFound(name)
                if self._resident(served):  # another request loaded it meanwhile
                    return self._hold(served)
            assert served.adapter is not None
            key = self._reload_adapter(served)
            with self._lock:
                old = (served.engine, served.adapter)
                for other, model in list(self._names.items()):
                    if (model.engine, model.adapter) == old:
                        self._names[other] = replace(model, adapter=key)
                self._loading.discard((id(served.engine), key))
                current = self._names.get(name, replace(served, adapter=key))
                held = self._hold(current)
                self.cold_loads += 1
            self._evict()
        logger.info("loaded cold adapter %s (%s) again", name, served.version[:12])
        return held

    def _reload_adapter(self, served: ServedModel) -> str:
        """Load ``served``'s checkpoint onto its engine under a new key, refusing it if the
        directory no longer holds the version the name was registered with."""
        engine = served.engine
        if not isinstance(engine, HFEngine):
            raise LoadRefused(f"{served.name} is not an adapter")
        key = f"a{next(self._keys)}"
        with self._lock:
            self._loading.add((id(engine), key))
        try:
            with verified_copy(Path(served.root)) as copy:
                if read_manifest(copy).checkpoint_id != served.version:
                    raise LoadRefused(
                        f"the checkpoint of {served.name!r} at {served.root} changed since it was "
                        f"loaded (it served {served.version[:12]}); load it again by name"
                    )
                engine.load_adapter(key, copy)
        except CheckpointError as exc:
            with self._lock:
                self._loading.discard((id(engine), key))
            raise LoadRefused(str(exc)) from exc
        except BaseException:
            with self._lock:
                self._loading.discard((id(engine), key))
            raise
        return key

    def _evict(self) -> None:
        """Unload the least recently requested adapters that no request holds until at most
        ``max_resident_adapters`` stay loaded. The caller holds the load lock."""
        if self._max_resident is None:
            return
        with self._lock:
            held = {(id(m.engine), m.adapter) for m, _ in self._in_flight.values()}
            engines = {id(m.engine): m.engine for m in self._names.values()}
            loaded = [
                (engine, key)
                for engine in engines.values()
                if isinstance(engine, HFEngine)
                for key in engine.adapters()
            ]
            over = len(loaded) - self._max_resident
            idle = [
                (engine, key)
                for engine, key in loaded
                if (id(engine), key) not in held and (id(engine), key) not in self._loading
            ]
            idle.sort(key=lambda item: self._last_used.get((id(item[0]), item[1]), -1))
            victims = idle[: max(0, over)]
            self._evicting.update((id(engine), key) for engine, key in victims)
        for engine, key in victims:
            engine.unload_adapter(key)
        with self._lock:
            for engine, key in victims:
                self._evicting.discard((id(engine), key))
                self._last_used.pop((id(engine), key), None)
            self.evictions += len(victims)

    def _prepare(self, name: str, path: Path) -> ServedModel:
        """Load (or share) the checkpoint's weights; nothing is switched yet."""
        created = int(time.time())
        manifest = manifest_of(path)
        if manifest.kind == "lora":
            return self._prepare_adapter(name, path, created)
        shared = self._resident_engine(manifest.checkpoint_id)
        engine = shared or load_engine(path, device=self._device)
        return ServedModel(name, engine, None, engine.version, str(path), None, created)

    def _resident_engine(self, version: str) -> Engine | None:
        """An engine already loaded with the checkpoint ``version`` (a name's model or base)."""
        return next((m.engine for m in self.names() if m.engine.version == version), None)

    def _prepare_adapter(self, name: str, path: Path, created: int) -> ServedModel:
        """An adapter on its base: the resident one, else the base from the checkpoint store."""
        try:
            manifest = verify_hf(path)
        except CheckpointError as exc:
            raise LoadRefused(str(exc)) from exc
        assert manifest.base is not None  # a lora manifest always names its base
        base_id = manifest.base.checkpoint_id
        engine = self._resident_engine(base_id)
        if engine is None:
            try:
                base_dir = resolve_base_dir(path, manifest, None)
                if base_dir.is_symlink():  # the store's entry, not whatever it points at
                    raise CheckpointError(f"{base_dir} is a symlink (refused)")
            except CheckpointError as exc:
                raise LoadRefused(
                    f"adapter {path} needs base model {base_id[:12]}, which this server does not "
                    f"serve and which is not in its checkpoint store: {exc}"
                ) from exc
            engine = load_engine(base_dir, device=self._device)
        if not isinstance(engine, HFEngine):
            raise LoadRefused(f"adapter {path} needs an hf base model, not {engine.family}")
        for other in self.names():
            if (
                other.engine is engine
                and other.adapter is not None
                and other.version == (manifest.checkpoint_id)
            ):
                return ServedModel(
                    name, engine, other.adapter, other.version, str(path), engine.version, created
                )
        key = f"a{next(self._keys)}"
        with self._lock:
            self._loading.add((id(engine), key))
        try:
            with verified_copy(path) as copy:
                try:
                    version = engine.load_adapter(key, copy)
                except CheckpointError as exc:
                    raise LoadRefused(str(exc).replace(str(copy), str(path))) from exc
        except BaseException:
            with self._lock:
                self._loading.discard((id(engine), key))
            raise
        return ServedModel(name, engine, key, version, str(path), engine.version, created)

    def _collect(self) -> None:
        """Unload adapters that no name and no request in flight points at.

        Full models need nothing: an engine nothing references is freed by the GC."""
        with self._lock:
            used = [*self._names.values(), *(m for m, _ in self._in_flight.values())]
            kept = {(id(m.engine), m.adapter) for m in used} | self._loading
        for engine in {id(m.engine): m.engine for m in used}.values():
            if isinstance(engine, HFEngine):
                for key in engine.adapters():
                    if (id(engine), key) not in kept:
                        engine.unload_adapter(key)
                        with self._lock:
                            self._last_used.pop((id(engine), key), None)
