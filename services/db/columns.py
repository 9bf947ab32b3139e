"""Column types and defaults every table module shares."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import DateTime, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

# JSON columns store Python None as SQL NULL, not as the JSON literal null.
JSON = JSONB(none_as_null=True)


def now_column() -> Mapped[dt.datetime]:
    """A non-null timestamptz that Postgres fills with the transaction's time."""
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)
