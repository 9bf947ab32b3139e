"""What several benchmarks need to run the api as its own process, as production does."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from services.environments.base import TaskSpec
from services.evaluation.evaluator import EvaluationResult
from services.evaluation.stats import PairedComparison, compare_paired
from services.secrets import generate_key

REPO = Path(__file__).resolve().parents[1]
BENCH_SECRET_KEY = generate_key()  # encrypts the loop's signing secret (services.secrets)


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


def paired_on(
    tasks: Sequence[TaskSpec], champion: EvaluationResult, candidate: EvaluationResult, *, seed: int
) -> PairedComparison:
    """Candidate against champion task by task on ``tasks``, at the gate's confidence."""
    ids = [t.task_id for t in tasks]
    return compare_paired(
        [champion.passes()[i] for i in ids],
        [candidate.passes()[i] for i in ids],
        confidence=0.95,
        seed=seed,
    )
