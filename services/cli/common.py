"""Helpers shared by CLI commands."""

from __future__ import annotations

from services.settings import Settings, get_settings


def cli_settings(*, require_database: bool = False) -> Settings:
    """Settings for a command; processes that need a database say so in one line."""
    from services.cli import CliError

    settings = get_settings()
    if require_database and settings.database_url is None:
        raise CliError(
            "RATCHET_DATABASE_URL is not set; set it to your Postgres, or run `ratchet up` "
            "to start the embedded stack"
        )
    return settings
