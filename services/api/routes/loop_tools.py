"""``GET /v1/loops/{loop}/tools``: a replay loop's live tool endpoint, its allow-list and
what the server lists (``ratchet loop tools``; services.loop.tools says why a server's
``readOnlyHint`` is shown and never trusted)."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import AdminDep, SessionDep, StateDep
from services.api.routes.loops import loop_or_404
from services.api.schemas.loops import LoopToolPublic, LoopToolsPublic
from services.loop.tools import loop_tools

router = APIRouter(prefix="/v1", tags=["loops"], dependencies=[AdminDep])


@router.get(
    "/loops/{loop}/tools",
    summary="The loop's live tool endpoint: its allow-list and the server's own listing",
    responses={404: {"description": "No such loop"}},
)
def list_loop_tools(loop: str, session: SessionDep, state: StateDep) -> LoopToolsPublic:
    row = loop_or_404(session, loop)
    found = loop_tools(row.curation_policy or {}, state.settings.tool_endpoints)
    return LoopToolsPublic(
        loop=row.name,
        endpoint=found.endpoint,
        kind=found.kind,
        error=found.error,
        tools=[
            LoopToolPublic(
                name=tool.name,
                allowed=tool.allowed,
                listed=tool.listed,
                read_only_hint=tool.read_only_hint,
                description=tool.description,
            )
            for tool in found.tools
        ],
    )
