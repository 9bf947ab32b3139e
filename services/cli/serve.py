"""`ratchet serve --checkpoint DIR`: serve the reference policy with hot swap.

The server refuses to start on a checkpoint that does not verify (one line, no traceback).
Swap it later without a restart: ``POST /v1/admin/swap {"checkpoint": "<dir>"}``, or let a
loop's local serving target do it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="checkpoint directory to serve first"
    )
    parser.add_argument("--host", default=None, help="bind address (default RATCHET_SERVE_HOST)")
    parser.add_argument("--port", default=None, type=int, help="port (default RATCHET_SERVE_PORT)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs"
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over HTTP (act, generate, hot swap, metrics)",
        description=(
            "Serve the reference policy from a checkpoint directory: POST /v1/act, "
            "GET /v1/model, /metrics, and hot swap through POST /v1/admin/swap."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.cli import CliError
    from services.cli.common import cli_settings
    from services.logs import configure_logging
    from services.serving.model import SwapRefused
    from services.serving.server import serve

    settings = cli_settings()
    configure_logging(settings.log_level, settings.log_format, component="serve")
    if not args.checkpoint.is_dir():
        raise CliError(f"checkpoint directory {args.checkpoint} does not exist")
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    try:
        serve(
            args.checkpoint.resolve(),
            host=args.host or settings.serve_host,
            port=args.port or settings.serve_port,
            admin_token=token,
            device=args.device,
        )
    except SwapRefused as exc:
        raise CliError(f"cannot serve {args.checkpoint}: {exc}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m services.serving``: the same command without the ``ratchet`` front."""
    from services.cli import CliError
    from services.settings import SettingsError

    parser = argparse.ArgumentParser(prog="python -m services.serving")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (CliError, SettingsError) as exc:
        print(f"ratchet serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
