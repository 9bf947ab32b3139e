"""The api's ``/metrics`` on a port of its own (``RATCHET_API_METRICS_PORT``).

The api port faces senders (and, through an ingress, the internet); metrics name every loop
and show its traffic, so in a cluster they are served on a separate port that only the
scrapers' NetworkPolicy rule reaches, and the api port answers 404 for ``/metrics``. When the
setting is unset (the embedded stack, everything on 127.0.0.1) they stay on the api port.

One server per ``ratchet api``, in the process that binds the api socket: with several
worker processes it sums their values from the multi-process directory, so every scrape
sees all of them.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from services.metrics import REGISTRY


def render(multiprocess_dir: Path | None) -> bytes:
    """Ratchet's registry, or every worker process's values summed."""
    if multiprocess_dir is None:
        return generate_latest(REGISTRY)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiprocess_dir))
    return generate_latest(registry)


class MetricsServer:
    """A small threaded HTTP server answering ``GET /metrics`` (and 404 for anything else)."""

    def __init__(self, host: str, port: int, multiprocess_dir: Path | None = None) -> None:
        directory = multiprocess_dir

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served on this port")
                    return
                body = render(directory)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes are not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="api-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
