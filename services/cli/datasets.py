"""`ratchet datasets list|show|export`: dataset snapshots (in services.curation.cli)."""

from services.curation.cli import register_datasets as register

__all__ = ["register"]
