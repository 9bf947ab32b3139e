"""``GET /v1/models`` and vLLM's runtime adapter API (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``): what is served, and changing it without a failed request.

Checkpoint directories (a card's ``root``) are shown only to clients that may load models
(a serving target compares them with what it loaded); others see the directory's name. A
load comes only from inside the model roots (:func:`checkpoint_dir_within`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from services.metrics import SERVING_SWAPS
from services.modelserver.openai_api import (
    VERSION_HEADER,
    LoadAdapterRequest,
    OpenAIError,
    UnloadAdapterRequest,
)
from services.modelserver.registry import (
    LoadRefused,
    ModelNotFound,
    ServedModel,
    checkpoint_dir_within,
)
from services.modelserver.state import ServerDep

logger = logging.getLogger(__name__)

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request, server: ServerDep) -> dict[str, Any]:
    paths = server.may_load(request)
    return {"object": "list", "data": [model_card(m, paths) for m in server.registry.names()]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request, server: ServerDep) -> dict[str, Any]:
    for served in server.registry.names():
        if served.name == name:
            return model_card(served, server.may_load(request))
    raise OpenAIError(
        404, f"the model {name!r} does not exist", param="model", code="model_not_found"
    )


@router.post("/v1/load_lora_adapter", response_model=None)
async def load_adapter(body: LoadAdapterRequest, request: Request, server: ServerDep) -> Response:
    server.check_adapter_access(request)
    try:
        path = checkpoint_dir_within(body.lora_path, server.roots)
    except LoadRefused as exc:
        SERVING_SWAPS.labels("rejected").inc()
        raise OpenAIError(400, str(exc), param="lora_path", code="load_refused") from None
    try:
        served = await run_in_threadpool(
            server.registry.load, body.lora_name, path, replace=body.load_inplace
        )
    except LoadRefused as exc:
        SERVING_SWAPS.labels("rejected").inc()
        logger.warning("loading %s as %s refused: %s", path, body.lora_name, exc)
        raise OpenAIError(400, str(exc), param="lora_path", code="load_refused") from exc
    SERVING_SWAPS.labels("ok").inc()
    return PlainTextResponse(
        f"Success: LoRA adapter '{body.lora_name}' added successfully.",
        headers={VERSION_HEADER: served.version},
    )


@router.post("/v1/unload_lora_adapter", response_model=None)
async def unload_adapter(
    body: UnloadAdapterRequest, request: Request, server: ServerDep
) -> Response:
    server.check_adapter_access(request)
    try:
        server.registry.unload(body.lora_name)
    except ModelNotFound:
        raise OpenAIError(
            404,
            f"no model named {body.lora_name!r} is loaded",
            param="lora_name",
            code="model_not_found",
        ) from None
    except LoadRefused as exc:
        raise OpenAIError(400, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def model_card(served: ServedModel, show_path: bool) -> dict[str, Any]:
    """vLLM's model card; ``root`` is the checkpoint directory for clients that may load
    models (a serving target compares it with what it loaded), else only its name."""
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "ratchet",
        "root": served.root if show_path else Path(served.root).name,
        "parent": served.parent,
        "max_model_len": served.engine.context_length(),
        "ratchet": {
            "version": served.version,
            "family": served.engine.family,
            "adapter": served.adapter is not None,
        },
    }
