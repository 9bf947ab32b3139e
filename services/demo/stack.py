"""The demo's own embedded stack: a fresh state directory on free ports."""

from __future__ import annotations

import socket
import time

from services.demo.options import DemoOptions
from services.settings import Settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def demo_settings(options: DemoOptions, base: Settings) -> Settings:
    """A fresh state dir and free ports, so a demo never collides with `ratchet up`."""
    state_dir = options.state_dir or base.state_dir / "demo" / time.strftime("%Y%m%d-%H%M%S")
    return base.model_copy(
        update={
            "state_dir": state_dir,
            "artifact_root": None,
            "database_url": None,
            "temporal_address": None,
            "api_port": _free_port(),
            "worker_port": _free_port(),
            "gateway_port": _free_port(),
            "temporal_port": _free_port(),
            "temporal_ui_port": _free_port(),
            "serve_port": _free_port(),
        }
    )


def stack_database_url(settings: Settings) -> str:
    """The embedded Postgres of the demo's stack, over its unix socket."""
    return f"postgresql://postgres:@/postgres?host={settings.embedded_postgres_dir}"
