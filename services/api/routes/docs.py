"""``/docs``: Swagger UI served from the installed package, so it works offline.

FastAPI's default ``/docs`` page loads Swagger UI's script and stylesheet from a CDN: on a
machine without internet access (an air-gapped cluster, a laptop on a plane) it is a blank
page. Swagger UI 5 (``swagger-ui-dist``, the version in ``static/swagger-ui/README.md``) is
vendored beside this module with its license, because the api's document is OpenAPI 3.1 and
the ``swagger-ui-bundle`` Python package stopped at Swagger UI 4.15, which cannot render 3.1.
The online validator badge is off (``validatorUrl: null``): it would send the document to
validator.swagger.io. ReDoc is not vendored, so ``/redoc`` is off (create_app) rather than
blank.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html, swagger_ui_default_parameters
from fastapi.responses import FileResponse, HTMLResponse

from services.api.errors import ApiError

router = APIRouter(include_in_schema=False, tags=["docs"])

SWAGGER_UI_VERSION = "5.36.0"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "static" / "swagger-ui"
ASSET_PREFIX = "/static/swagger-ui"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
PARAMETERS = {**swagger_ui_default_parameters, "validatorUrl": None}


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    # ``?v=``: a browser holding the day-long cached files of an older Swagger UI fetches anew.
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title="Ratchet API",
        swagger_js_url=f"{root}{ASSET_PREFIX}/swagger-ui-bundle.js?v={SWAGGER_UI_VERSION}",
        swagger_css_url=f"{root}{ASSET_PREFIX}/swagger-ui.css?v={SWAGGER_UI_VERSION}",
        swagger_favicon_url=f"{root}{ASSET_PREFIX}/favicon-32x32.png",
        swagger_ui_parameters=PARAMETERS,
    )


@router.get(ASSET_PREFIX + "/{filename}")
def swagger_asset(filename: str) -> FileResponse:
    media_type = ASSETS.get(filename)
    if media_type is None:
        raise ApiError(404, "not_found", f"no Swagger UI file {filename!r}")
    return FileResponse(
        ASSETS_DIR / filename,
        media_type=media_type,
        headers={"Cache-Control": "public, max-age=86400"},
    )
