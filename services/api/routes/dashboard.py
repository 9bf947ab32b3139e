"""The loop dashboard, served at ``/``: loops overview, loop page, run page, task page.

Pages are server-rendered and read-only; the actions on the loop page are small JavaScript
calls to the admin API (``/v1/loops/{loop}/{action}``) with the token the operator pastes,
so these routes never need it. Every page runs in a read-only transaction and is sent with
a Content Security Policy that allows no inline script or style, as a second wall behind
the templates' escaping.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import HTMLResponse
from sqlalchemy import text
from sqlalchemy.orm import Session

from services.api.deps import SessionDep, SettingsDep
from services.api.errors import ApiError
from services.dashboard.links import TemporalLinks
from services.dashboard.pages import loop_context, overview_context, run_context, task_context
from services.dashboard.render import STATIC_TYPES, render, static_bytes
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.settings import Settings
from workflows.ids import cycle_workflow_id, loop_workflow_id

router = APIRouter(include_in_schema=False, tags=["dashboard"])

# How often an open page reloads itself (the operator can switch it off on the page).
REFRESH_SECONDS = 30

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _read_only_session(session: SessionDep) -> Session:
    """The request's session, in a transaction Postgres refuses to write in."""
    session.execute(text("SET TRANSACTION READ ONLY"))
    return session


ReadOnlySession = Annotated[Session, Depends(_read_only_session)]


def _links(settings: Settings) -> TemporalLinks:
    return TemporalLinks(
        ui_url=settings.effective_temporal_ui_url,
        namespace=settings.temporal_namespace,
        loop_workflow_id=loop_workflow_id,
        cycle_workflow_id=cycle_workflow_id,
    )


def _page(
    request: Request, settings: Settings, template: str, *, status_code: int = 200, **context: Any
) -> HTMLResponse:
    html = render(
        template,
        base=str(request.scope.get("root_path", "")).rstrip("/"),
        now=dt.datetime.now(dt.UTC),
        temporal_ui_url=settings.effective_temporal_ui_url,
        refresh_seconds=REFRESH_SECONDS,
        **context,
    )
    return HTMLResponse(html, status_code=status_code, headers=PAGE_HEADERS)


def _not_found(request: Request, settings: Settings, message: str) -> HTMLResponse:
    return _page(request, settings, "not_found.html", status_code=404, message=message)


@router.get("/", response_class=HTMLResponse, summary="Loops overview")
def overview(request: Request, session: ReadOnlySession, settings: SettingsDep) -> HTMLResponse:
    return _page(request, settings, "overview.html", **overview_context(session))


@router.get("/loops/{name}", response_class=HTMLResponse, summary="One loop")
def loop_page(
    name: str, request: Request, session: ReadOnlySession, settings: SettingsDep
) -> HTMLResponse:
    try:
        loop = require_loop(session=session, name=name)
    except NotFound:
        return _not_found(request, settings, f"There is no loop named {name!r}.")
    context = loop_context(
        session,
        loop=loop,
        links=_links(settings),
        cached_token_weight=settings.serving_cached_token_weight,
    )
    return _page(request, settings, "loop.html", **context)


@router.get("/loops/{name}/runs/{run_id:path}", response_class=HTMLResponse, summary="One run")
def run_page(
    name: str, run_id: str, request: Request, session: ReadOnlySession, settings: SettingsDep
) -> HTMLResponse:
    try:
        loop = require_loop(session=session, name=name)
    except NotFound:
        return _not_found(request, settings, f"There is no loop named {name!r}.")
    context = run_context(
        session,
        loop=loop,
        run_id=run_id,
        links=_links(settings),
        log_roots=[settings.state_dir, settings.artifacts_dir],
    )
    if context is None:
        return _not_found(request, settings, f"Loop {name!r} has no run {run_id!r}.")
    return _page(request, settings, "run.html", **context)


@router.get("/loops/{name}/tasks/{task_id}", response_class=HTMLResponse, summary="One task")
def task_page(
    name: str, task_id: str, request: Request, session: ReadOnlySession, settings: SettingsDep
) -> HTMLResponse:
    """A task with its stored successes and failures (its demonstrations)."""
    try:
        loop = require_loop(session=session, name=name)
    except NotFound:
        return _not_found(request, settings, f"There is no loop named {name!r}.")
    context = task_context(session, loop=loop, task_ref=task_id)
    if context is None:
        return _not_found(request, settings, f"Loop {name!r} has no task {task_id!r}.")
    return _page(request, settings, "task.html", **context)


@router.get("/static/dashboard/{filename}", summary="Dashboard script and stylesheet")
def static(filename: str) -> Response:
    media_type = STATIC_TYPES.get(filename)
    if media_type is None:
        raise ApiError(404, "not_found", f"no static file {filename!r}")
    return Response(
        static_bytes(filename),
        media_type=media_type,
        headers={
            "Cache-Control": "public, max-age=31536000, immutable",
            "X-Content-Type-Options": "nosniff",
        },
    )
