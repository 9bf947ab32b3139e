"""Tables partitioned by time: which they are, their partitions, and how partitions are made
ahead and retired.

What grows with traffic is partitioned by range of the time it arrived, one partition per UTC
day or ISO week (``RATCHET_PARTITION_PERIOD``): trace bodies (``trace_bodies``) and OTLP span
payloads (``otlp_span_payloads``), both by ``received_at`` (services.db.models_partitioned).
Retention then retires a whole partition instead of rewriting rows one by one, which at
100M rows is hours of WAL and vacuum per day of data. It does so in two transactions: the
detach (a catalog change, whatever the rows, under a lock that makes every ingest and listing
wait; the detached table's foreign key to ``traces`` goes with it) commits first; the drop of
the detached table follows in a transaction of its own, locking nothing else, since
freeing a file takes time in proportion to its bytes (the kernel drops its cached pages and
frees its blocks: ~65 ms for 46 MB and ~460 ms for 465 MB on the development machine's ext4,
which discards online) and nothing waits for it there. A detached table a crash left behind
is dropped by the next run (:func:`drop_detached_partitions`).

Partitions are made ``RATCHET_PARTITIONS_AHEAD`` periods ahead by the worker's retention
schedule (workflows/retention.py), and by the migration that made the tables. Each table
also has a DEFAULT partition, so a row whose period has no partition yet (the schedule
stopped for longer than the periods made ahead) is still stored: ingest never fails for want
of a partition. When its period's partition is made later, such rows move into it
(:func:`create_partition`), and rows past retention are deleted from the default one.

Bounds are UTC: a day starts at 00:00 UTC, a week on Monday 00:00 UTC. A partition is named
after its table and lower bound (``trace_bodies_p20261207``); its bounds are read back from
the catalog, never from the name, so switching between daily and weekly only changes the
partitions made from then on (a new one starts where the last one ends).

Every function takes the session keyword-only and never commits; maintenance of one table
holds a transaction-level advisory lock (:func:`lock_table_maintenance`), so two workers
never make or retire the same partition at once.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

logger = logging.getLogger(__name__)

Period = Literal["daily", "weekly"]
PERIODS: tuple[Period, ...] = ("daily", "weekly")

# Namespace of the maintenance advisory locks (the other key is the table's position).
_LOCK_NAMESPACE = 0x525054  # "RPT"
# DDL on a partitioned table waits for the queries reading it; a maintenance run that cannot
# have its lock soon gives up (the next run retries) instead of queueing every query behind it.
LOCK_TIMEOUT = "5s"


@dataclass(frozen=True)
class PartitionedTable:
    """A table partitioned by range of ``key`` (a timestamptz column)."""

    name: str
    key: str

    @property
    def default_partition(self) -> str:
        return f"{self.name}_default"

    def partition_name(self, lower: dt.datetime) -> str:
        return f"{self.name}_p{lower.astimezone(dt.UTC):%Y%m%d}"


TRACE_BODIES = PartitionedTable("trace_bodies", "received_at")
OTLP_SPAN_PAYLOADS = PartitionedTable("otlp_span_payloads", "received_at")
PARTITIONED_TABLES = (TRACE_BODIES, OTLP_SPAN_PAYLOADS)

# The partitions' own names: what schema comparisons (Alembic's autogenerate) skip, since the
# models describe the partitioned tables, not the partitions the schedule makes.
PARTITION_NAME = re.compile(
    r"^(" + "|".join(t.name for t in PARTITIONED_TABLES) + r")_(p\d{8}|default)$"
)


def is_partition(name: str | None) -> bool:
    return name is not None and PARTITION_NAME.match(name) is not None


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic's ``include_name`` hook: compare every table but the partitions."""
    return not (type_ == "table" and is_partition(name))


@dataclass(frozen=True)
class Partition:
    """One partition and its range ``[lower, upper)``."""

    name: str
    lower: dt.datetime
    upper: dt.datetime


@dataclass(frozen=True)
class Retired:
    """A partition retention dropped, and about how many rows it held (the planner's
    estimate, ``pg_class.reltuples``: counting them exactly would read the whole partition)."""

    name: str
    lower: dt.datetime
    upper: dt.datetime
    rows: int


# Periods ------------------------------------------------------------------------------------


def period_start(at: dt.datetime, period: Period) -> dt.datetime:
    """The start of the period holding ``at`` (UTC midnight; for a week, Monday's)."""
    day = at.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "weekly":
        day -= dt.timedelta(days=day.weekday())
    return day


def period_end(start: dt.datetime, period: Period) -> dt.datetime:
    return start + dt.timedelta(days=7 if period == "weekly" else 1)


def wanted_ranges(
    now: dt.datetime, period: Period, ahead: int
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The ranges that should exist at ``now``: the current period and ``ahead`` more."""
    ranges = []
    start = period_start(now, period)
    for _ in range(ahead + 1):
        end = period_end(start, period)
        ranges.append((start, end))
        start = end
    return ranges


def missing_ranges(
    wanted: list[tuple[dt.datetime, dt.datetime]], existing: list[Partition]
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The parts of ``wanted`` no existing partition covers, each a range of its own (a
    wanted day inside an existing week is covered; a week after existing days starts where
    the last day ends)."""
    missing = []
    for lower, upper in wanted:
        for part in sorted(existing, key=lambda p: p.lower):
            if part.upper <= lower or part.lower >= upper:
                continue
            if part.lower <= lower:
                lower = max(lower, part.upper)
            else:  # an existing partition starts inside: what comes before it is missing
                missing.append((lower, part.lower))
                lower = part.upper
            if lower >= upper:
                break
        if lower < upper:
            missing.append((lower, upper))
    return missing


# The catalog --------------------------------------------------------------------------------

# The bounds as text include their UTC offset, so casting them back is exact whatever the
# session's time zone.
_PARTITIONS_SQL = text(
    r"""
    SELECT c.relname,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid),
                         'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)'))[1]::timestamptz,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid),
                         'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)'))[2]::timestamptz
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
      JOIN pg_class p ON p.oid = i.inhparent
     WHERE p.relname = :parent AND p.relnamespace = to_regnamespace(current_schema())::oid
       AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
     ORDER BY 2
    """
)


def partitions(*, session: Session, table: PartitionedTable) -> list[Partition]:
    """The table's range partitions (not the default one), oldest first."""
    rows = session.execute(_PARTITIONS_SQL, {"parent": table.name}).all()
    return [Partition(name, lower, upper) for name, lower, upper in rows]


def lock_table_maintenance(*, session: Session, table: PartitionedTable) -> bool:
    """Take the table's maintenance lock for this transaction; False when another holds it."""
    key = PARTITIONED_TABLES.index(table)
    return bool(
        session.execute(
            text("SELECT pg_try_advisory_xact_lock(:namespace, :key)"),
            {"namespace": _LOCK_NAMESPACE, "key": key},
        ).scalar_one()
    )


# Making partitions --------------------------------------------------------------------------


def _literal(at: dt.datetime) -> str:
    """A timestamptz literal for DDL (partition bounds cannot be bind parameters)."""
    return f"'{at.astimezone(dt.UTC).isoformat()}'"


def create_partition(
    *, session: Session, table: PartitionedTable, lower: dt.datetime, upper: dt.datetime
) -> str:
    """Make the partition ``[lower, upper)`` of ``table``; rows of that range waiting in the
    default partition move into it in the same transaction. Returns its name."""
    name = table.partition_name(lower)
    bounds = f"FOR VALUES FROM ({_literal(lower)}) TO ({_literal(upper)})"
    in_range = f"{table.key} >= {_literal(lower)} AND {table.key} < {_literal(upper)}"
    stranded = session.execute(
        text(f"SELECT EXISTS (SELECT 1 FROM {table.default_partition} WHERE {in_range})")
    ).scalar_one()
    if not stranded:
        session.execute(text(f"CREATE TABLE {name} PARTITION OF {table.name} {bounds}"))
        return name
    # Postgres refuses a partition whose rows sit in the default one: move them first.
    session.execute(
        text(f"CREATE TABLE {name} (LIKE {table.name} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    )
    session.execute(
        text(
            f"WITH moved AS (DELETE FROM {table.default_partition} WHERE {in_range} RETURNING *) "
            f"INSERT INTO {name} SELECT * FROM moved"
        )
    )
    session.execute(text(f"ALTER TABLE {table.name} ATTACH PARTITION {name} {bounds}"))
    logger.warning("partitions: moved rows of %s out of %s", name, table.default_partition)
    return name


def ensure_partitions(
    *, session: Session, table: PartitionedTable, now: dt.datetime, period: Period, ahead: int
) -> list[str]:
    """Make the partitions of the current period and ``ahead`` more that do not exist yet
    (idempotent); the names of those made."""
    session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    existing = partitions(session=session, table=table)
    wanted = wanted_ranges(now, period, ahead)
    return [
        create_partition(session=session, table=table, lower=lower, upper=upper)
        for lower, upper in missing_ranges(wanted, existing)
    ]


# Retiring partitions ------------------------------------------------------------------------

# Whether a partition may go now; retention keeps it until the next run otherwise.
RetireCheck = Callable[[Session, Partition], bool]

# The lower bound recorded for rows retired from the default partition (they have no range).
BEGINNING = dt.datetime(1, 1, 1, tzinfo=dt.UTC)

_RECORD_SQL = text(
    "INSERT INTO partition_retirements (table_name, lower, upper, rows, retired_at) "
    "VALUES (:table, :lower, :upper, :rows, :now)"
)


def retire_partitions(
    *,
    session: Session,
    table: PartitionedTable,
    before: dt.datetime,
    now: dt.datetime,
    may_retire: RetireCheck | None = None,
) -> list[Retired]:
    """Detach every partition wholly older than ``before`` (``may_retire`` may hold one
    back), then delete the rows older than ``before`` from the default partition (normally
    none); each retired range is recorded in ``partition_retirements`` at ``now``. Idempotent.
    Commit, then drop the detached tables (:func:`drop_detached_partitions`) in a transaction
    of their own, so the table is locked for the catalog change only.

    The caller holds the table's maintenance lock (:func:`lock_table_maintenance`)."""
    session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    retired = []
    for part in partitions(session=session, table=table):
        if part.upper > before:
            break
        if may_retire is not None and not may_retire(session, part):
            logger.warning("retention: %s holds rows still in use; kept for now", part.name)
            continue
        rows = session.execute(
            text(
                "SELECT greatest(reltuples, 0)::bigint FROM pg_class "
                "WHERE oid = CAST(:name AS regclass)"
            ),
            {"name": part.name},
        ).scalar_one()
        session.execute(text(f"ALTER TABLE {table.name} DETACH PARTITION {part.name}"))
        _drop_foreign_keys(session=session, name=part.name)
        retired.append(Retired(part.name, part.lower, part.upper, int(rows)))
    deleted = session.execute(
        text(f"DELETE FROM {table.default_partition} WHERE {table.key} < :before"),
        {"before": before},
    ).rowcount  # type: ignore[attr-defined]
    if deleted:
        retired.append(Retired(table.default_partition, BEGINNING, before, int(deleted)))
    for done in retired:
        session.execute(
            _RECORD_SQL,
            {
                "table": table.name,
                "lower": done.lower,
                "upper": done.upper,
                "rows": done.rows,
                "now": now,
            },
        )
    return retired


def _drop_foreign_keys(*, session: Session, name: str) -> None:
    """Drop a detached partition's foreign keys (it keeps its copy of the parent's, to
    ``traces`` for the bodies) while the detach's locks are held: dropping the table with a
    key would lock the table it references (every ingest) while its file is freed."""
    keys = session.execute(
        text(
            "SELECT conname FROM pg_constraint "
            "WHERE conrelid = CAST(:name AS regclass) AND contype = 'f'"
        ),
        {"name": name},
    ).scalars()
    for key in list(keys):
        quoted = key.replace('"', '""')
        session.execute(text(f'ALTER TABLE {name} DROP CONSTRAINT "{quoted}"'))


# Detached tables: the partitions of ``table`` retention detached and did not drop yet. A
# partition being made is never seen here: it is made attached, or made and attached in one
# transaction (create_partition), and the catalog shows other transactions committed tables.
_DETACHED_SQL = text(
    r"""
    SELECT c.relname
      FROM pg_class c
     WHERE c.relnamespace = to_regnamespace(current_schema())::oid
       AND c.relkind = 'r' AND NOT c.relispartition
       AND c.relname ~ :pattern
     ORDER BY c.relname
    """
)


def detached_partitions(*, session: Session, table: PartitionedTable) -> list[str]:
    """Tables named as partitions of ``table`` that are no longer attached to it."""
    pattern = f"^{re.escape(table.name)}_p[0-9]{{8}}$"
    return list(session.execute(_DETACHED_SQL, {"pattern": pattern}).scalars())


def drop_detached_partitions(*, session: Session, table: PartitionedTable) -> list[str]:
    """Drop what retention detached from ``table`` (also what a crash left between the two
    transactions); the names dropped. The caller holds the table's maintenance lock."""
    session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    dropped = detached_partitions(session=session, table=table)
    for name in dropped:
        session.execute(text(f"DROP TABLE {name}"))
    return dropped
