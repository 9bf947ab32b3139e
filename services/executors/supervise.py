"""The supervisor of one local job: runs it, waits for it, writes down how it ended.

``python -m services.executors.supervise --state-dir DIR --log FILE -- COMMAND...``

The local executor starts this small process in a session of its own (so cancel can kill
the supervisor and the job as one process group) instead of the job itself, because the
exit status of a process can only be collected by its parent: a worker that restarted is
no longer the job's parent. The supervisor is, and it records the outcome in
``DIR/exit.json`` (exit code, signal, the job's CPU seconds from ``wait4``, times), which any
later worker can read. Its own identity (pid and start time) goes to
``DIR/supervisor.json`` first thing, so an adopting worker can tell it from a recycled pid.

Standard library only: it runs next to the job, not in the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

SUPERVISOR_FILE = "supervisor.json"
EXIT_FILE = "exit.json"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so a reader sees the old file or the whole new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a link planted under the temporary name goes, its target stays
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(tmp, flags, 0o644), "w") as fh:
        json.dump(data, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m services.executors.supervise")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--log", required=True, type=Path)
    parser.add_argument("--cwd", type=Path, default=None)
    argv = list(argv)
    if "--" not in argv:
        parser.error("the job command must follow '--'")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("the job command is empty")
    return args, command


def supervise(state_dir: Path, log_path: Path, command: list[str], cwd: Path | None) -> int:
    """Run ``command`` with output to ``log_path``; record its end in ``state_dir``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(state_dir / SUPERVISOR_FILE, {"pid": os.getpid(), "started_at": time.time()})
    signals_received: list[int] = []

    def remember(signum: int, _frame: FrameType | None) -> None:
        # The job is in our process group and got the same signal; keep waiting for it so
        # its exit status is recorded.
        signals_received.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, remember)

    started_at = time.time()
    # Appended to, never through a link (O_NOFOLLOW): the run directory is the job's.
    log_fd = os.open(
        log_path,
        os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0),
        0o644,
    )
    with os.fdopen(log_fd, "ab") as log:
        try:
            child = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
            )
        except OSError as exc:
            log.write(f"cannot start job command {command[0]!r}: {exc}\n".encode())
            log.flush()
            write_json_atomic(
                state_dir / EXIT_FILE,
                {
                    "returncode": 127,
                    "signal": None,
                    "cpu_seconds": 0.0,
                    "started_at": started_at,
                    "ended_at": time.time(),
                    "error": f"cannot start job command {command[0]!r}: {exc.strerror or exc}",
                },
            )
            return 127
        write_json_atomic(state_dir / "child.json", {"pid": child.pid})
        _, wait_status, usage = os.wait4(child.pid, 0)
    ended_at = time.time()
    killed_by = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    returncode = os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else -(killed_by or 0)
    write_json_atomic(
        state_dir / EXIT_FILE,
        {
            "returncode": returncode,
            "signal": killed_by,
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "max_rss_kb": usage.ru_maxrss,
            "started_at": started_at,
            "ended_at": ended_at,
            "signals_received": signals_received,
        },
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    return supervise(args.state_dir, args.log, command, args.cwd)


if __name__ == "__main__":
    sys.exit(main())
