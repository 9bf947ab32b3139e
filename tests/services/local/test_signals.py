"""SIGTERM unwinds a process that starts children like Ctrl-C, so its cleanup runs."""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from pathlib import Path

import pytest

from services.local.stack import Terminated, stop_children_on_signals


def test_sigterm_unwinds_and_a_second_signal_does_not_cut_the_cleanup_short() -> None:
    cleaned: list[str] = []
    with pytest.raises(Terminated), stop_children_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # ignored while cleaning up
            time.sleep(0.05)
            cleaned.append("stack stopped")
    assert cleaned == ["stack stopped"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_an_interrupt_swallowed_by_a_weakref_callback_is_raised_again() -> None:
    class Thing:
        pass

    def callback(_: object) -> None:
        time.sleep(0.3)  # the signal's exception lands here, where Python only prints it

    with pytest.raises(Terminated), stop_children_on_signals(redeliver_s=0.2):
        thing = Thing()
        reference = weakref.ref(thing, callback)
        # One SIGTERM, delivered while the main thread is inside the callback.
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        del thing
        assert reference() is None
        time.sleep(5)


def test_a_killed_processes_handle_on_the_embedded_postgres_is_dropped(tmp_path: Path) -> None:
    """pgserver stops the server when the last listed process lets go; a `ratchet up` killed
    with -9 never does, so its pid must not keep the next one from stopping the server."""
    import json
    import subprocess
    import sys

    from services.local.stack import forget_dead_handles

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    handles = tmp_path / ".handle_pids.json"
    handles.write_text(json.dumps([dead.pid, os.getpid()]))
    forget_dead_handles(tmp_path)
    assert json.loads(handles.read_text()) == [os.getpid()]
