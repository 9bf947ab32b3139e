"""One trace client: Ratchet's own code posts traces only through ``ratchet_client``
(clients/python), the client its users post with, so a fix to signing, batching or retries
reaches the demo's traffic and every user alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_of_services_signs_webhooks_itself() -> None:
    offenders = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if name.split(".")[0] == "standardwebhooks"
            ]
    assert offenders == []


def test_the_demo_traffic_posts_through_ratchet_client() -> None:
    from services.demo import traffic

    assert traffic.TraceClient.__module__ == "ratchet_client._client"
