"""``/docs`` in a real browser: Swagger UI renders the OpenAPI 3.1 document the api serves.

A 200 for ``/docs`` proves nothing: Swagger UI 4 answers 200 and then shows "Unable to render
this definition" for a 3.1 document. This test reads what Chromium rendered, with every
request to anything but the api refused (the page must work offline).
"""

from __future__ import annotations

from playwright.sync_api import Route

from tests.services.dashboard.conftest import BrowserPage, LiveServer


def test_swagger_ui_renders_the_operations_offline(
    empty_server: LiveServer, browser_page: BrowserPage
) -> None:
    page = browser_page.page
    foreign: list[str] = []

    def refuse_foreign(route: Route) -> None:
        if route.request.url.startswith(empty_server.url):
            route.continue_()
        else:
            foreign.append(route.request.url)
            route.abort()

    page.route("**/*", refuse_foreign)
    response = page.goto(f"{empty_server.url}/docs")
    assert response is not None and response.status == 200

    # Either outcome ends the wait: the operations, or Swagger UI's error for the document.
    page.wait_for_function(
        """() => {
            const text = document.querySelector('#swagger-ui')?.innerText ?? '';
            return text.includes('/v1/loops/{loop}/traces') || text.includes('Unable to render');
        }""",
        timeout=30_000,
    )
    body = page.locator("#swagger-ui").inner_text()
    assert "Unable to render this definition" not in body
    assert "Post one trace or a batch (Standard Webhooks signature)" in body
    assert "List a loop's traces, newest first" in body
    assert "OAS 3.1" in body
    assert foreign == []
    assert browser_page.errors == []
