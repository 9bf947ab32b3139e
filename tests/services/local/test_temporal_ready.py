"""`ratchet up` waits for Temporal to be healthy, not for its port to open once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from services.local.stack import EmbeddedTemporal, StackError, check_temporal_reachable
from services.settings import Settings
from tests.services.local.test_stack import free_port


def test_the_health_check_polls_until_a_late_temporal_is_serving(tmp_path: Path) -> None:
    port = free_port()
    settings = Settings(temporal_address=f"127.0.0.1:{port}", state_dir=tmp_path)
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            check_temporal_reachable(settings, timeout=90)
            outcome.append(None)
        except StackError as exc:
            outcome.append(exc)

    checker = threading.Thread(target=check)
    checker.start()
    time.sleep(1.0)  # the first attempts find nothing listening
    temporal = EmbeddedTemporal(
        db_file=tmp_path / "temporal.db",
        port=port,
        ui_port=free_port(),
        namespace="default",
        log_file=tmp_path / "temporal.log",
    )
    temporal.start()
    try:
        checker.join(timeout=120)
    finally:
        temporal.stop()
    assert outcome == [None]
