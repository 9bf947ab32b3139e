"""Typed dependencies for routes (``Annotated`` aliases), so routes stay thin."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session
from temporalio.client import Client

from services.api.errors import ApiError
from services.api.state import AppState
from services.settings import Settings


async def get_state(request: Request) -> AppState:
    """Async on purpose: a plain function would cost a thread hop on every request."""
    state: AppState = request.app.state.ratchet
    return state


async def get_settings_dep(state: Annotated[AppState, Depends(get_state)]) -> Settings:
    return state.settings


def get_session(state: Annotated[AppState, Depends(get_state)]) -> Iterator[Session]:
    """A session in a transaction that commits when the route returns without error."""
    with state.session_factory.begin() as session:
        yield session


async def get_temporal(state: Annotated[AppState, Depends(get_state)]) -> Client:
    try:
        return await state.temporal.get()
    except Exception as exc:
        raise ApiError(
            503,
            "temporal_unavailable",
            f"Temporal at {state.settings.effective_temporal_address} is not reachable: {exc}",
            headers={"Retry-After": "5"},
        ) from exc


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def require_admin(
    state: Annotated[AppState, Depends(get_state)],
    authorization: Annotated[str | None, Header()] = None,
) -> None:
    """The admin API needs ``Authorization: Bearer $RATCHET_ADMIN_TOKEN``.

    With no admin token configured the admin API is closed, not open: a forgotten setting
    must not expose it.
    """
    configured = state.settings.admin_token
    if configured is None:
        raise ApiError(
            403,
            "admin_disabled",
            "the admin API is disabled: set RATCHET_ADMIN_TOKEN on the api to enable it",
        )
    given = bearer_token(authorization)
    if given is None or not hmac.compare_digest(
        given.encode(), configured.get_secret_value().encode()
    ):
        raise ApiError(
            401,
            "unauthorized",
            "missing or wrong admin token (Authorization: Bearer <RATCHET_ADMIN_TOKEN>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
TemporalDep = Annotated[Client, Depends(get_temporal)]
AdminDep = Depends(require_admin)
