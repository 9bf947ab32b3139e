"""``/docs``: Swagger UI served from the installed package, so it works offline.

FastAPI's default ``/docs`` page loads Swagger UI's script and stylesheet from a CDN: on a
machine without internet access (an air-gapped cluster, a laptop on a plane) it is a blank
page. The assets ship in the ``swagger-ui-bundle`` package (Swagger UI 4.15); this module
serves the three files the page needs from it. ReDoc has no such package, so ``/redoc`` is
off (create_app) rather than blank.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from services.api.errors import ApiError

router = APIRouter(include_in_schema=False, tags=["docs"])

ASSET_PREFIX = "/static/swagger-ui"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}


def assets_dir() -> Path:
    """Where the installed ``swagger-ui-bundle`` keeps Swagger UI's files."""
    from swagger_ui_bundle import swagger_ui_path

    return Path(str(swagger_ui_path))


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title="Ratchet API",
        swagger_js_url=f"{root}{ASSET_PREFIX}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSET_PREFIX}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSET_PREFIX}/favicon-32x32.png",
    )


@router.get(ASSET_PREFIX + "/{filename}")
def swagger_asset(filename: str) -> FileResponse:
    media_type = ASSETS.get(filename)
    if media_type is None:
        raise ApiError(404, "not_found", f"no Swagger UI file {filename!r}")
    return FileResponse(
        assets_dir() / filename,
        media_type=media_type,
        headers={"Cache-Control": "public, max-age=86400"},
    )
