"""What several benchmarks share: the api as its own process, as production does, a database
with a loop and checkpoints to serve. Torch-free at import (the ingest and curation
benchmarks do not need it). The SmolLM2 drift-recovery runs' parts are in
``benchmarks/drift.py``."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import psycopg

from services.db.migrate import upgrade
from services.db.queries.loops import LoopFields
from services.db.queries.trace_inserts import TRACE_COLUMNS
from services.db.session import create_db_engine, make_session_factory
from services.ingest.provisioning import ProvisionedLoop, provision_loop
from services.secrets import SecretBox, generate_key
from services.serving.base import CheckpointRef

REPO = Path(__file__).resolve().parents[1]
BENCH_SECRET_KEY = generate_key()  # encrypts the loop's signing secret (services.secrets)


def random_tiny_checkpoints(root: Path, count: int) -> list[CheckpointRef]:
    """``count`` checkpoints of the reference policy's shape under ``root``, each with its own
    random weights (so its own checkpoint id): versions for a serving target to swap between."""
    import torch

    from services.training.checkpoint import save_checkpoint
    from services.training.tiny.model import GPT, GPTConfig

    config = GPTConfig()
    refs = []
    for seed in range(count):
        torch.manual_seed(seed)
        path = root / f"tiny-{seed}"
        manifest = save_checkpoint(GPT(config), config, path)
        refs.append(CheckpointRef(id=manifest.checkpoint_id, uri=path.as_uri()))
    return refs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_api_process(
    database_url: str, port: int, env: Mapping[str, str], *, repo: Path = REPO
) -> subprocess.Popen[bytes]:
    """``ratchet api`` of the checkout at ``repo`` on 127.0.0.1:``port``, with ``env`` and the
    settings every benchmark gives it; returned once it answers /healthz, so that no benchmark
    times the start."""
    env = {
        **env,
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_API_HOST": "127.0.0.1",
        "RATCHET_API_PORT": str(port),
        "RATCHET_ADMIN_TOKEN": "bench",
        "RATCHET_SECRET_KEY": BENCH_SECRET_KEY,
        "RATCHET_LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services", "api"], cwd=repo, env=env, stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the api exited with code {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the api did not start within 60 s")


class Postgres(Protocol):
    """What the benchmarks use of a ``pgserver`` server (imported lazily: a test extra)."""

    def get_uri(self, database: str) -> str: ...

    def get_pid(self) -> int | None: ...


@contextmanager
def temporary_postgres(prefix: str) -> Iterator[tuple[Postgres, Path]]:
    """A Postgres of the benchmark's own (pgserver) and a scratch directory beside it, both
    gone afterwards, so a run measures a fresh database and leaves nothing behind."""
    import pgserver

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = pgserver.get_server(Path(tmp) / "pg", cleanup_mode="stop")
        try:
            yield server, Path(tmp)
        finally:
            server.cleanup()


def create_loop_database(
    server: Postgres, loop: str, *, database: str = "ratchet_bench"
) -> tuple[str, ProvisionedLoop]:
    """A migrated ``database`` on ``server`` holding one toolcalc loop named ``loop``;
    returns the database's URL and the loop's credentials, so that a benchmark posts traces
    as a real client would."""
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    database_url = server.get_uri(database)
    upgrade(database_url)
    engine = create_db_engine(database_url, pool_size=1)
    try:
        with make_session_factory(engine).begin() as session:
            created = provision_loop(
                session,
                fields=LoopFields(name=loop, environment="toolcalc"),
                box=SecretBox.from_keys(BENCH_SECRET_KEY),
            )
    finally:
        engine.dispose()
    return database_url, created


@dataclass(frozen=True)
class LoopApi:
    """A benchmark's own Postgres holding one loop, and ``ratchet api`` in front of it."""

    server: Postgres
    database_url: str
    loop: ProvisionedLoop
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop_api(self) -> None:
        """Stop the api; the database stays up (to measure Postgres alone afterwards)."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@contextmanager
def api_over_loop(
    prefix: str, loop: str, env: Mapping[str, str], *, repo: Path = REPO
) -> Iterator[LoopApi]:
    """What an ingest benchmark posts to: a fresh Postgres with loop ``loop`` and the api of
    the checkout at ``repo`` with ``env``, all gone afterwards."""
    with temporary_postgres(prefix) as (server, _):
        database_url, created = create_loop_database(server, loop)
        port = free_port()
        stack = LoopApi(
            server,
            database_url,
            created,
            port,
            start_api_process(database_url, port, env, repo=repo),
        )
        try:
            yield stack
        finally:
            stack.stop_api()


# The trace columns a COPY loads, the body apart (it goes to ``trace_bodies``).
TRACE_ROW_COLUMNS = tuple(name for name in TRACE_COLUMNS if name != "body")


def copy_traces(
    conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]], received_at: Sequence[Any]
) -> None:
    """COPY ``rows`` (values in TRACE_COLUMNS order, the body as JSON text) into ``traces``
    and their bodies into ``trace_bodies``, received at ``received_at`` (one per row): what
    the ingest writer stores, at the speed of a plain COPY. Ids are a block taken from the
    table's sequence, so the api can keep inserting beside the loaded rows."""
    if not rows:
        return
    body = TRACE_COLUMNS.index("body")
    start = conn.execute(
        "SELECT setval(pg_get_serial_sequence('traces', 'id'), "
        "nextval(pg_get_serial_sequence('traces', 'id')) + %s - 1)",
        (len(rows),),
    ).fetchone()
    assert start is not None
    first = int(start[0]) - len(rows) + 1
    columns = ", ".join(("id", *TRACE_ROW_COLUMNS, "received_at"))
    with conn.cursor().copy(f"COPY traces ({columns}) FROM STDIN") as copy:
        for offset, (row, at) in enumerate(zip(rows, received_at, strict=True)):
            copy.write_row((first + offset, *row[:body], *row[body + 1 :], at))
    with conn.cursor().copy("COPY trace_bodies (trace_id, received_at, body) FROM STDIN") as copy:
        for offset, (row, at) in enumerate(zip(rows, received_at, strict=True)):
            copy.write_row((first + offset, at, row[body]))
