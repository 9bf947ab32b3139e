"""`ratchet up` tells a stop from a crash: a child that ends as stopped children do (Ctrl-C
reaches the whole process group) is an info line and exit 0; any other exit is an error."""

from __future__ import annotations

import logging
import signal

import pytest

from services.local.stack import _child_exited


@pytest.mark.parametrize("code", [0, 130, -signal.SIGINT, -signal.SIGTERM])
def test_a_stopped_child_is_not_an_error(code: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="services.local.stack"):
        assert _child_exited("api", code) == 0
    [record] = caplog.records
    assert record.levelno == logging.INFO and "stopped" in record.getMessage()


@pytest.mark.parametrize("code", [1, 3, -signal.SIGKILL])
def test_a_crashed_child_is_an_error(code: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="services.local.stack"):
        assert _child_exited("worker", code) == 1
    [record] = caplog.records
    assert record.levelno == logging.ERROR and f"exited with code {code}" in record.getMessage()
