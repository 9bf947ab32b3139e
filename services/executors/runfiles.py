"""Opening files of a run's directory that a job may have tampered with.

A job writes into its run directory (its output, its logs), and on a shared volume it may
plant a symbolic link there: ``logs/job.log -> <state>/secret.key`` for the dashboard to
show, or a dangling ``logs/job.log -> /elsewhere/file`` for the worker to create when it
saves a pod's logs. So a reader or writer of such a file never resolves a path: it starts
from a directory it trusts (an artifact or state root, which the deployment made) and walks
each further component with ``O_NOFOLLOW``, so a link anywhere below the root is refused,
and the file itself must be a regular file (``fstat`` after the open, so a swap between a
check and the open is caught too). A new file is created with ``O_EXCL``: never through a
link, never over a file a job put there first.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafeRunFile(Exception):
    """A run file that is not read or written: a link, not a regular file, outside the root."""


def relative_parts(root: Path, path: Path) -> tuple[str, ...]:
    """The components of ``path`` below ``root``, compared without resolving ``path``.

    ``..`` is refused rather than resolved, and so is a path that is not under the root.
    """
    if not path.is_absolute():
        raise UnsafeRunFile(f"{path} is not an absolute path")
    if ".." in path.parts:
        raise UnsafeRunFile(f"{path} contains '..'")
    try:
        base = root.expanduser().resolve()
    except OSError as exc:
        raise UnsafeRunFile(f"the root {root} cannot be resolved: {exc.strerror}") from None
    for candidate in (root.expanduser(), base):
        with contextlib.suppress(ValueError):
            parts = path.relative_to(candidate).parts
            if parts:
                return parts
    raise UnsafeRunFile(f"{path} is not under {root}")


@contextlib.contextmanager
def _directory(root: Path, parts: tuple[str, ...], *, create: bool) -> Iterator[int]:
    """A descriptor of ``root/parts...``, each component opened without following a link."""
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for part in parts:
            if part in ("", ".", ".."):
                raise UnsafeRunFile(f"{part!r} is not a directory name")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeRunFile(
                        f"{part!r} under {root} is a symbolic link or not a directory (refused)"
                    ) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def open_for_reading(root: Path, path: Path) -> int:
    """A read-only descriptor of the regular file ``path`` under the trusted ``root``.

    Raises :class:`UnsafeRunFile` for a link (the file or any directory below the root), a
    file that is not regular (a FIFO, a device, a directory) or a path outside the root;
    ``FileNotFoundError`` when it does not exist.
    """
    *dirs, name = relative_parts(root, path)
    with _directory(root, tuple(dirs), create=False) as parent:
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeRunFile(f"{path} is a symbolic link (not followed)") from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeRunFile(f"{path} is not a regular file")
    return fd


def create_exclusive(root: Path, path: Path, *, mode: int = 0o644) -> int:
    """A write-only descriptor of a new file ``path`` under the trusted ``root``.

    Missing directories are made; none may be a link. ``FileExistsError`` when anything
    (a file, a link, dangling or not) already has the name: nothing is written through it.
    """
    *dirs, name = relative_parts(root, path)
    with _directory(root, tuple(dirs), create=True) as parent:
        return os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=parent
        )


def refuse_links(root: Path, directory: Path) -> None:
    """:class:`UnsafeRunFile` when a job's output ``directory`` (under the trusted ``root``)
    is reached through a symbolic link, or holds one anywhere inside it.

    Readers of job output open each file with ``O_NOFOLLOW``, which guards the file's own
    name only: ``output/checkpoint -> /elsewhere`` would still lead the worker out of the
    run's directory. Job output never needs a link (DESIGN §5: symlinks and non-regular
    files in job output are refused), so one anywhere refuses the whole output.
    ``FileNotFoundError`` when the directory does not exist. Relative paths are taken from
    the working directory (a relative state directory), never resolved through links.
    """
    root, directory = root.absolute(), directory.absolute()
    parts = relative_parts(root, directory)
    with _directory(root, parts, create=False) as fd:
        found = _first_link(fd, directory)
    if found is not None:
        raise UnsafeRunFile(f"{found} is a symbolic link (job output holds none)")


def _first_link(fd: int, where: Path) -> Path | None:
    """The first symbolic link below the directory open as ``fd`` (depth first)."""
    with os.scandir(fd) as entries:
        names = sorted((entry.name, entry.is_symlink(), entry.is_dir()) for entry in entries)
    for name, is_link, is_dir in names:
        if is_link:
            return where / name
        if is_dir:
            child = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            try:
                found = _first_link(child, where / name)
            finally:
                os.close(child)
            if found is not None:
                return found
    return None


def read_tail_bytes(fd: int, max_bytes: int) -> tuple[bytes, int]:
    """The last ``max_bytes`` of an open file and the offset they start at; closes ``fd``."""
    with os.fdopen(fd, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        handle.seek(start)
        return handle.read(max_bytes), start


def read_text(root: Path, path: Path) -> str:
    """The whole text of a regular run file (see :func:`open_for_reading`)."""
    with os.fdopen(open_for_reading(root, path), "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


__all__ = [
    "UnsafeRunFile",
    "create_exclusive",
    "open_for_reading",
    "read_tail_bytes",
    "read_text",
    "refuse_links",
    "relative_parts",
]
