"""The one place that builds engines and session factories.

Nothing here runs at import time: callers (the api's lifespan, the worker's composition
root, the CLI, tests) build an engine from settings and pass the session factory down.
Sessions never commit inside query functions; the caller owns the transaction
(``with session_factory.begin() as session: ...``).
"""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from services.settings import Settings, to_sqlalchemy_url

SessionFactory = sessionmaker[Session]


def create_db_engine(
    database_url: str, *, pool_size: int = 10, application: str = "ratchet"
) -> Engine:
    """An engine with a pool sized for the process and a server-side statement timeout."""
    return create_engine(
        to_sqlalchemy_url(database_url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args={"application_name": application, "connect_timeout": 5},
    )


def engine_from_settings(settings: Settings, *, application: str = "ratchet") -> Engine:
    return create_db_engine(
        settings.sqlalchemy_url(), pool_size=settings.database_pool_size, application=application
    )


def make_session_factory(engine: Engine) -> SessionFactory:
    return sessionmaker(bind=engine, expire_on_commit=False)


def ping(engine: Engine) -> None:
    """Raise if Postgres cannot answer a trivial query (used by /readyz)."""
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
