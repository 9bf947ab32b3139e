"""``/docs`` works offline: Swagger UI's page and every file it loads come from the api."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient


def test_swagger_ui_loads_only_files_the_api_serves(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "SwaggerUIBundle" in page.text
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


def test_only_the_swagger_ui_files_are_served(client: TestClient) -> None:
    for name in ("../__init__.py", "index.html", "swagger-ui.js.map", "nope"):
        response = client.get(f"/static/swagger-ui/{name}")
        assert response.status_code == 404, name
    assert client.get("/redoc").status_code == 404
