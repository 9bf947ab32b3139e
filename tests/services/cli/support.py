"""Running ``ratchet`` in-process and capturing what it printed."""

from __future__ import annotations

import pytest

from services.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of ``ratchet *argv``."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
