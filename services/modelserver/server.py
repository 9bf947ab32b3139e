"""The model server (``ratchet serve``): the OpenAI chat-completions API, batched, hot-swapping.

It is what vLLM or SGLang are on a GPU cluster, for a laptop and for CI, and it speaks the
same API, so an agent written against the ``openai`` client runs against either unchanged:

- ``POST /v1/chat/completions`` — messages, ``tools``, ``tool_choice``, ``temperature``,
  ``top_p``, ``max_tokens``, ``n``, ``seed``, ``stop``, ``stream`` (server-sent events);
  answers with ``tool_calls`` (parsed per model family), ``finish_reason`` and ``usage``;
  ``logprobs``/``top_logprobs`` and vLLM's ``return_token_ids`` return what was sampled
  (:mod:`services.modelserver.openai_api` says which log-probs);
- ``POST /v1/completions`` — a prompt as text or as token ids, the same sampling, stopping,
  streaming, ``logprobs`` (0..20, OpenAI's legacy shape) and ``return_token_ids``: what a
  remote rollout sends (:mod:`services.inference.remote`);
- ``GET /v1/models`` — every served name with its checkpoint directory (``root``) and, for
  an adapter, its base (``parent``); ``ratchet.version`` is the checkpoint id;
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` — vLLM's runtime adapter API. Here
  ``lora_path`` may also name a full checkpoint (vLLM accepts adapters only), and
  ``load_inplace`` swaps what a name serves without a failed request
  (:mod:`services.modelserver.registry`);
- ``GET /health``, ``GET /v1/stats``, ``GET /metrics``.

Concurrent requests are decoded together (:mod:`services.modelserver.scheduler`). Every
completion names the checkpoint that produced it in ``system_fingerprint`` and in the
``X-Ratchet-Model-Version`` header; with ``RATCHET_SERVE_ATTESTATION_KEY`` set its response
``id`` is signed for that checkpoint, so a trace that records the id is tagged by the server's
word, not the client's (:mod:`services.modelserver.attestation`).

Under careless or hostile clients (:mod:`services.modelserver.guards` is the door): with
``RATCHET_SERVE_API_KEY`` set every route but ``/health`` needs it (or the admin key,
``RATCHET_SERVE_ADMIN_KEY``) as a Bearer token, and only the admin key loads or unloads
models, so the key agents hold serves and never swaps; bodies
are capped before parsing (413); a conversation too long for the context is refused before
it is rendered, and rendering runs off the event loop; at most ``queue_max`` rows wait (429
with ``Retry-After`` past that); a client that hangs up has its rows cancelled, streaming or
not. The adapter endpoints need the admin key whenever a key is set or the server listens
beyond loopback, and load only checkpoints inside the model roots; a checkpoint is loaded
from a private copy of exactly the files its manifest lists
(:func:`services.modelserver.registry.verified_copy`).

The routes live in :mod:`services.modelserver.routes` (completions, models, status), sharing
one :class:`~services.modelserver.state.ServerState`; this module assembles the app and runs
it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI

from services.modelserver.errors import install_error_handlers
from services.modelserver.guards import DoorPolicy, ServingDoor, is_loopback
from services.modelserver.registry import ModelRegistry
from services.modelserver.routes import completions, models, status
from services.modelserver.scheduler import BatchScheduler
from services.modelserver.state import ServerState, ServingStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_MAX = 256


@dataclass(frozen=True)
class ServerOptions:
    """How the model server guards its door and batches, whatever it serves.

    ``api_key``: required of every request but /health when set; it serves, never swaps.
    ``admin_key``: the only key the adapter routes take (it serves too); it must differ from
    ``api_key``. ``model_roots``: the directories adapter loads may come from (None: those
    holding the models served at the start). ``attestation_key``: signs each response id
    for the version that answered (:mod:`services.modelserver.attestation`).
    """

    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    max_batch_rows: int = 32
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    queue_max: int = DEFAULT_QUEUE_MAX
    model_roots: Sequence[Path] | None = None
    attestation_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError(
                "RATCHET_SERVE_ADMIN_KEY must differ from RATCHET_SERVE_API_KEY: the key "
                "handed to agents would load and unload models"
            )


def create_serving_app(
    registry: ModelRegistry,
    options: ServerOptions = ServerOptions(),
    *,
    bind_host: str = "127.0.0.1",
) -> FastAPI:
    """The model server's app over ``registry`` (loaded by the caller: nothing loads here).

    ``bind_host``: where the server listens (beyond loopback the adapter routes need the key).
    """
    policy = DoorPolicy(
        api_key=options.api_key,
        bind_host=bind_host,
        max_body_bytes=options.max_body_bytes,
        admin_key=options.admin_key,
    )
    roots = (
        list(options.model_roots)
        if options.model_roots is not None
        else list(dict.fromkeys(Path(m.root).parent for m in registry.names()))
    )
    scheduler = BatchScheduler(
        max_batch_rows=options.max_batch_rows, max_waiting_rows=options.queue_max
    )
    scheduler.start()
    server = ServerState(
        registry, scheduler, ServingStats(), policy, roots, options.attestation_key
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(
        title="Ratchet model server",
        description="OpenAI-compatible chat completions, batched, with hot swap.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.server = server
    app.add_middleware(ServingDoor, policy=policy)
    install_error_handlers(app)
    for routes in (completions, models, status):
        app.include_router(routes.router)
    return app


def serve(
    checkpoint: Path,
    *,
    host: str,
    port: int,
    model_name: str,
    device: str = "auto",
    threads: int | None = None,
    options: ServerOptions = ServerOptions(),
) -> None:
    """Load ``checkpoint`` as ``model_name`` (refusing an invalid one before binding), serve.

    Adapter loads may come from ``options.model_roots``; none given means the directory
    holding ``checkpoint``."""
    import torch
    import uvicorn

    if threads is not None:
        torch.set_num_threads(threads)
    registry = ModelRegistry(device=device)
    served = registry.load(model_name, checkpoint)
    roots = list(options.model_roots or ()) or [checkpoint.parent]
    app = create_serving_app(registry, replace(options, model_roots=roots), bind_host=host)
    if options.api_key is None and not is_loopback(host):
        logger.warning(
            "listening on %s without RATCHET_SERVE_API_KEY: anyone who reaches the port may "
            "ask for completions",
            host,
        )
    if options.admin_key is None and (options.api_key is not None or not is_loopback(host)):
        logger.warning(
            "no RATCHET_SERVE_ADMIN_KEY: the adapter routes (load and unload) are refused to "
            "every client"
        )
    logger.info(
        "serving %s (%s) as %r on http://%s:%d",
        served.version[:12],
        checkpoint,
        model_name,
        host,
        port,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
