"""A loop's bootstrap: whether it may run, and the base model it trains over.

``ratchet loop bootstrap`` (docs/loops.md, "A first champion by bootstrap") trains an SFT-LoRA
adapter over the loop's base model on its successful train-split traces
(services.curation.bootstrap) and proposes it through the gate against that base model. The
api answers a request at once with what a bootstrap would see, or why it cannot run; the
worker's bootstrap activity asks the same questions again when the cycle runs, since the loop
may have changed in between. Both go through :func:`check_request` and :func:`resolve_base`,
so the reasons read the same wherever they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore, uri_to_path
from services.checkpoints import install_checkpoint, record_checkpoint
from services.db.models import Checkpoint, Loop
from services.environments.replay.env import ENVIRONMENT_NAME as REPLAY
from services.loop.policies import CHECKPOINT_ID_PATTERN, TrainingProfile
from services.training.checkpoint_manifest import CheckpointError

_HINT_BASE = (
    "pass --base with a checkpoint id of the store (`ratchet models import DIR` prints it) or "
    "a model directory, or set training_profile.base_checkpoint"
)


class BootstrapProblem(Exception):
    """Why a bootstrap cannot run: a stable ``code``, a sentence, the request or loop field
    at fault (if one is) and the HTTP status the api answers with (409: the loop's state,
    422: its configuration or the request)."""

    def __init__(
        self, code: str, message: str, *, field: str | None = None, status: int = 422
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.status = status


@dataclass(frozen=True)
class BaseCheckpoint:
    """The base model a bootstrap trains over and judges its adapter against."""

    checkpoint_id: str
    uri: str


def check_request(loop: Loop, profile: TrainingProfile, *, force: bool) -> None:
    """Refuse a bootstrap the loop cannot run (:class:`BootstrapProblem`)."""
    if loop.environment != REPLAY:
        raise BootstrapProblem(
            "bootstrap_unsupported",
            f"loop {loop.name!r} runs the {loop.environment} environment; bootstrap learns from "
            "the recorded conversations of successful traces, which only the replay "
            "environment keeps (a toolcalc loop's first champion: `ratchet models import DIR "
            "--loop NAME`, or the solver's demonstrations as `ratchet demo` makes them)",
            field="environment",
        )
    if profile.family != "hf":
        raise BootstrapProblem(
            "wrong_family",
            f"bootstrap trains an hf LoRA adapter; loop {loop.name!r} has family "
            f"{profile.family!r} (set training_profile.family to hf)",
            field="training_profile.family",
        )
    if loop.champion_checkpoint_id is not None and not force:
        raise BootstrapProblem(
            "has_champion",
            f"loop {loop.name!r} already has champion {loop.champion_checkpoint_id[:12]}; "
            "bootstrap makes a first one. --force bootstraps anyway: the adapter is judged "
            "against the base model, and on promotion it replaces the champion (`ratchet "
            "loop rollback` restores it)",
            field="force",
            status=409,
        )


def resolve_base(
    session: Session, store: ArtifactStore, *, loop: Loop, profile: TrainingProfile, ref: str | None
) -> BaseCheckpoint:
    """The base model: ``ref`` (a checkpoint id of the store, or a model directory to
    install) or else the profile's ``base_checkpoint``; verified, installed if need be and
    recorded (idempotent: its id is its content). Refused unless a full hf model."""
    ref = ref or profile.base_checkpoint
    if ref is None:
        raise BootstrapProblem(
            "no_base_model", f"loop {loop.name!r} names no base model: {_HINT_BASE}", field="base"
        )
    source = _source(store, ref)
    try:
        installed = install_checkpoint(source, store)
    except CheckpointError as exc:
        raise BootstrapProblem(
            "invalid_base", f"base model {ref} rejected: {exc}", field="base"
        ) from None
    family, kind = installed.manifest.get("family", "tiny"), installed.manifest.get("kind", "full")
    if family != "hf" or kind != "full":
        raise BootstrapProblem(
            "invalid_base",
            f"base model {installed.checkpoint_id[:12]} is a {family} {kind} checkpoint; "
            "bootstrap trains a LoRA adapter over a full hf model",
            field="base",
        )
    row: Checkpoint = record_checkpoint(
        session=session, installed=installed, loop_id=loop.id, parent_id=None, run_id=None
    )
    return BaseCheckpoint(row.id, row.uri)


def _source(store: ArtifactStore, ref: str) -> Path:
    """The directory ``ref`` names: the store's copy of a checkpoint id, or a path/URI."""
    if CHECKPOINT_ID_PATTERN.fullmatch(ref):
        directory = store.checkpoint_dir(ref)
        if not directory.is_dir():
            raise BootstrapProblem(
                "invalid_base",
                f"checkpoint {ref[:12]} is not in the store: import it first (`ratchet models "
                "import DIR`)",
                field="base",
            )
        return directory
    try:
        directory = uri_to_path(ref)
    except ValueError as exc:
        raise BootstrapProblem("invalid_base", str(exc), field="base") from None
    if not directory.is_dir():
        raise BootstrapProblem(
            "invalid_base", f"{directory} is not a directory readable here", field="base"
        )
    return directory
