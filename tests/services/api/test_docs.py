"""``/docs`` works offline: Swagger UI's page and every file it loads come from the api.

What Chromium renders from them is in tests/services/dashboard/test_api_docs_page.py."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from services.api.routes.docs import ASSETS, ASSETS_DIR, SWAGGER_UI_VERSION


def test_swagger_ui_loads_only_files_the_api_serves(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "SwaggerUIBundle" in page.text
    assert "validatorUrl" in page.text  # no badge that sends the document to swagger.io
    urls = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    urls += re.findall(r"""url: ['"]([^'"]+)['"]""", page.text)
    assert urls, page.text
    assert not [u for u in urls if u.startswith(("http:", "https:", "//"))], urls
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, url
        assert response.content, url
    script = client.get("/static/swagger-ui/swagger-ui-bundle.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "SwaggerUIBundle" in script.text
    assert client.get("/openapi.json").json()["info"]["title"] == "Ratchet"


def test_the_vendored_swagger_ui_is_the_stated_version_with_its_license() -> None:
    for name in ASSETS:
        assert (ASSETS_DIR / name).is_file(), name
    bundle = (ASSETS_DIR / "swagger-ui-bundle.js").read_text()
    assert f'PACKAGE_VERSION:"{SWAGGER_UI_VERSION}"' in bundle
    readme = (ASSETS_DIR / "README.md").read_text()
    assert f"`swagger-ui-dist` {SWAGGER_UI_VERSION}" in readme
    assert "Apache License" in (ASSETS_DIR / "LICENSE").read_text()
    assert (ASSETS_DIR / "swagger-ui-bundle.js.LICENSE.txt").is_file()
    assert (ASSETS_DIR / "NOTICE").is_file()


def test_the_package_ships_the_vendored_files() -> None:
    """setuptools' package data names them: a wheel without them serves a blank /docs."""
    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    assert '"services.api" = ["static/swagger-ui/*"]' in pyproject
    assert "swagger-ui-bundle" not in pyproject


def test_only_the_swagger_ui_files_are_served(client: TestClient) -> None:
    for name in ("../__init__.py", "index.html", "swagger-ui.js.map", "README.md", "nope"):
        response = client.get(f"/static/swagger-ui/{name}")
        assert response.status_code == 404, name
    assert client.get("/redoc").status_code == 404
