"""A run's log tail is read only from regular files under the allowed roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.dashboard.logs_tail import clean_line, read_logs_tail


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path.as_uri()


def test_reads_the_last_lines(root: Path) -> None:
    uri = _write(root / "runs" / "r1" / "stderr.log", "".join(f"line {i}\n" for i in range(500)))
    tail = read_logs_tail(uri, allowed_roots=[root], max_lines=3)
    assert tail.lines == ["line 497", "line 498", "line 499"]
    assert tail.truncated
    assert tail.unavailable is None
    assert tail.path == str(root / "runs" / "r1" / "stderr.log")


def test_a_short_log_is_shown_whole(root: Path) -> None:
    tail = read_logs_tail(_write(root / "a.log", "one\ntwo"), allowed_roots=[root])
    assert tail.lines == ["one", "two"]
    assert not tail.truncated


def test_only_the_last_bytes_are_read_and_a_cut_line_is_dropped(root: Path) -> None:
    uri = _write(root / "big.log", "x" * 5000 + "\nlast but one\nlast\n")
    tail = read_logs_tail(uri, allowed_roots=[root], max_bytes=100)
    assert tail.lines == ["last but one", "last"]
    assert tail.truncated


def test_terminal_escapes_and_control_characters_are_stripped(root: Path) -> None:
    uri = _write(root / "c.log", "\x1b[31mred\x1b[0m\tok\x07\r\n\x1b]0;title\x07plain\n")
    assert read_logs_tail(uri, allowed_roots=[root]).lines == ["red\tok", "plain"]
    assert clean_line("a\x00b\x1b[2Kc") == "abc"


def test_invalid_utf8_is_replaced_not_fatal(root: Path) -> None:
    path = root / "bin.log"
    path.write_bytes(b"ok \xff\xfe bytes\n")
    assert read_logs_tail(path.as_uri(), allowed_roots=[root]).lines == ["ok \ufffd\ufffd bytes"]


def test_a_file_outside_the_roots_is_not_read(root: Path, tmp_path: Path) -> None:
    outside = _write(tmp_path / "elsewhere" / "secret.txt", "top secret\n")
    tail = read_logs_tail(outside, allowed_roots=[root])
    assert tail.lines == []
    assert "outside" in (tail.unavailable or "")
    assert "outside" in (
        read_logs_tail("file:///etc/passwd", allowed_roots=[root]).unavailable or ""
    )


def test_a_symlink_out_of_the_roots_is_not_followed(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    link = root / "runs" / "r1.log"
    link.parent.mkdir()
    os.symlink(secret, link)
    tail = read_logs_tail(link.as_uri(), allowed_roots=[root])
    assert tail.lines == []
    assert "symbolic link" in (tail.unavailable or "")


def test_dot_dot_cannot_climb_out(root: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("top secret\n")
    tail = read_logs_tail(f"file://{root}/../secret.txt", allowed_roots=[root])
    assert tail.lines == []
    assert "outside" in (tail.unavailable or "")


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        (None, "not recorded any logs"),
        ("", "not recorded any logs"),
        (
            "k8s://default/ratchet-train-r1",
            "kept by the executor at k8s://default/ratchet-train-r1",
        ),
        ("https://logs.example.com/r1", "kept by the executor"),
        ("file://otherhost/var/log/r1.log", "another host"),
        ("file:relative/r1.log", "not an absolute file path"),
    ],
)
def test_uris_that_are_not_local_files_get_a_reason(
    root: Path, uri: str | None, reason: str
) -> None:
    tail = read_logs_tail(uri, allowed_roots=[root])
    assert tail.lines == []
    assert reason in (tail.unavailable or "")


def test_a_missing_file_and_a_directory(root: Path) -> None:
    assert "does not exist" in (
        read_logs_tail((root / "nope.log").as_uri(), allowed_roots=[root]).unavailable or ""
    )
    (root / "runs").mkdir()
    assert "not a regular file" in (
        read_logs_tail((root / "runs").as_uri(), allowed_roots=[root]).unavailable or ""
    )


def test_limits_must_be_positive(root: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        read_logs_tail("file:///x", allowed_roots=[root], max_lines=0)


def _run_logs(root: Path) -> Path:
    logs = root / "artifacts" / "loops" / "l1" / "runs" / "r1" / "logs"
    logs.mkdir(parents=True)
    return logs


def test_a_job_planted_symlink_to_a_file_inside_the_roots_is_not_followed(root: Path) -> None:
    """A job replaced its log with a link to the state dir's key: the link is inside the
    allowed roots, and still nothing is read through it."""
    (root / "secret.key").write_text("the fernet key\n")
    logs = _run_logs(root)
    os.symlink(root / "secret.key", logs / "job.log")
    tail = read_logs_tail((logs / "job.log").as_uri(), allowed_roots=[root])
    assert tail.lines == []
    assert "symbolic link" in (tail.unavailable or "")


def test_a_symlinked_directory_on_the_way_is_not_followed(root: Path) -> None:
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "job.log").write_text("not this run's\n")
    run = root / "artifacts" / "loops" / "l1" / "runs" / "r1"
    run.mkdir(parents=True)
    os.symlink(root / "elsewhere", run / "logs")
    tail = read_logs_tail((run / "logs" / "job.log").as_uri(), allowed_roots=[root])
    assert tail.lines == []
    assert "symbolic link" in (tail.unavailable or "")


def test_a_fifo_is_not_opened(root: Path) -> None:
    logs = _run_logs(root)
    os.mkfifo(logs / "job.log")
    tail = read_logs_tail((logs / "job.log").as_uri(), allowed_roots=[root])
    assert tail.lines == []
    assert "not a regular file" in (tail.unavailable or "")


def test_only_the_runs_own_directory_is_read(root: Path) -> None:
    logs = _run_logs(root)
    (logs / "job.log").write_text("mine\n")
    other = root / "artifacts" / "loops" / "l1" / "runs" / "r2" / "logs"
    other.mkdir(parents=True)
    (other / "job.log").write_text("another run's\n")
    own = Path("loops/l1/runs/r1")
    roots = [root, root / "artifacts"]  # the state dir holds the artifact root
    assert read_logs_tail((logs / "job.log").as_uri(), allowed_roots=roots, within=own).lines == [
        "mine"
    ]
    tail = read_logs_tail((other / "job.log").as_uri(), allowed_roots=roots, within=own)
    assert tail.lines == []
    assert "outside the run's own directory" in (tail.unavailable or "")
