"""`ratchet serve --checkpoint DIR`: an OpenAI-compatible model server, batched, with hot swap.

The server refuses to start on a checkpoint that does not verify (one line, no traceback).
Serve more versions or adapters later without a restart, as on vLLM:
``POST /v1/load_lora_adapter {"lora_name": "agent-v2", "lora_path": "<dir>"}`` (add
``"load_inplace": true`` to swap what a name serves), or let a loop's serving target do it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.cli.common import add_command

DEFAULT_MODEL_NAME = "ratchet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="checkpoint directory to serve first"
    )
    parser.add_argument(
        "--served-model-name",
        default=DEFAULT_MODEL_NAME,
        help=f"the name clients put in `model` (default {DEFAULT_MODEL_NAME!r}, as vLLM's flag)",
    )
    parser.add_argument("--host", default=None, help="bind address (default RATCHET_SERVE_HOST)")
    parser.add_argument("--port", default=None, type=int, help="port (default RATCHET_SERVE_PORT)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs"
    )
    parser.add_argument(
        "--threads",
        default=None,
        type=int,
        help="CPU threads for the model (default: torch's; 1 keeps a core free for the rest)",
    )
    parser.add_argument(
        "--max-batch-rows",
        default=32,
        type=int,
        help="most sequences decoded together in one batch (default 32)",
    )


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers,
        "serve",
        run,
        help="serve a checkpoint over the OpenAI API (chat completions, tools, hot swap)",
    )
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve a checkpoint (tiny or hf family) as an OpenAI-compatible server:
    POST /v1/chat/completions (tools, streaming), GET /v1/models, and vLLM's
    POST /v1/load_lora_adapter and /v1/unload_lora_adapter for hot swap. Concurrent requests
    are decoded in batches.

    Security (environment or config file, never argv): RATCHET_SERVE_API_KEY makes every
    route but /health need `Authorization: Bearer <key>` and serves only;
    RATCHET_SERVE_ADMIN_KEY is the one key the adapter routes take (it serves too), required
    for them whenever a key is set or --host is not a loopback address. Adapters load only from
    RATCHET_SERVE_MODEL_ROOTS (default: the artifact store and the directory holding
    --checkpoint). RATCHET_SERVE_MAX_BODY_BYTES caps request bodies (413);
    RATCHET_SERVE_QUEUE_MAX bounds the rows waiting to decode (429 past it);
    RATCHET_SERVE_ATTESTATION_KEY signs each response id for the checkpoint that answered.
    """
    from services.cli import CliError
    from services.cli.common import cli_settings
    from services.logs import configure_logging
    from services.modelserver.attestation import attestation_key
    from services.modelserver.registry import LoadRefused
    from services.modelserver.server import ServerOptions, serve

    settings = cli_settings()
    configure_logging(settings.log_level, settings.log_format, component="serve")
    if not args.checkpoint.is_dir():
        raise CliError(f"checkpoint directory {args.checkpoint} does not exist")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    if args.max_batch_rows < 1:
        raise CliError("--max-batch-rows must be >= 1")
    if not args.served_model_name.strip():
        raise CliError("--served-model-name must not be empty")
    try:
        args.served_model_name.encode("utf-8")
    except UnicodeEncodeError:
        raise CliError("--served-model-name must be valid UTF-8") from None
    # The key comes from the environment or the config file only: argv is visible in ps.
    key = settings.serve_api_key.get_secret_value() if settings.serve_api_key else None
    admin = settings.serve_admin_key.get_secret_value() if settings.serve_admin_key else None
    if admin is not None and admin == key:
        raise CliError(
            "RATCHET_SERVE_ADMIN_KEY must differ from RATCHET_SERVE_API_KEY: the key handed "
            "to agents would load and unload models"
        )
    checkpoint = args.checkpoint.absolute()
    roots = settings.serve_model_roots or [settings.artifacts_dir, checkpoint.parent]
    try:
        serve(
            checkpoint,
            host=args.host or settings.serve_host,
            port=args.port or settings.serve_port,
            model_name=args.served_model_name,
            device=args.device,
            threads=args.threads,
            options=ServerOptions(
                api_key=key,
                admin_key=admin,
                max_batch_rows=args.max_batch_rows,
                max_body_bytes=settings.serve_max_body_bytes,
                queue_max=settings.serve_queue_max,
                # Kept even before they exist: the artifact store is made by the first job.
                model_roots=[root.absolute() for root in roots],
                attestation_key=attestation_key(settings),
            ),
        )
    except LoadRefused as exc:
        raise CliError(f"cannot serve {args.checkpoint}: {exc}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m services.modelserver``: the same command without the ``ratchet`` front."""
    from services.cli import CliError
    from services.settings import SettingsError

    parser = argparse.ArgumentParser(prog="python -m services.modelserver")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (CliError, SettingsError) as exc:
        print(f"ratchet serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
