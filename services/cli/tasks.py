"""`ratchet tasks list|show|pin`: curated tasks (implemented in services.curation.cli)."""

from services.curation.cli import register_tasks as register

__all__ = ["register"]
