"""The loop end to end, measured: `ratchet demo` run programmatically.

Prints the demo's progress and table, then ONE JSON line with promotions, live success on
the drifted API before and after the promotion (traces in Postgres, the canary's query), the
demo's wall time, the orchestration overhead (DESIGN: cycle wall time minus job time, over
the cycle wall time; the worst cycle; the canary window is part of it and reported on its
own as ``canary_window_s``), and the three numbers: ``heldout_points_gained`` (the frozen
held-out set, the headline), ``gate_points`` (the eval-set delta the gate decided on, biased
toward the candidate by construction) and ``live_points_gained`` (the canary's live delta),
with ``usd_per_heldout_point``. ``points_gained`` is kept and equals the held-out points.
``tokens_served`` and ``serving_usd_per_mtok`` are the serving ledger's (every champion's
tenure together; services.loop.ledger).
Each headline also comes with its counts and 95 % interval: ``live_success_before_figure`` and
``live_success_after_figure`` (Wilson), ``live_change`` (Newcombe), ``heldout_gain`` (paired
bootstrap, the one cycle that bought the points), ``cycle_figures`` (each cycle's held-out,
gate and live numbers) and ``notes`` (a held-out interval wider than ±15 points says so).
``estimate_usd`` (the estimates made before training, summed over the cycles estimated),
``actual_usd`` (what the cycles cost), ``cost_by_phase`` (their dollars per phase: rollout,
scoring, update, sync, evaluation, other) and ``cycle_wall_s`` (the mean cycle wall time)
show where the money went and how well it was foreseen.

The toy champion is pre-exposed to v2's names (``champion_note`` in the JSON says how); a
figure from this benchmark is a measurement of the loop on that champion, not of learning a
drift from nothing.

    python benchmarks/loop.py [--cycles 1] [--drift-at 45] [--traffic 4] [--traffic-workers N]
                              [--champion-cache DIR]
    python benchmarks/loop.py --model smollm2    # the real LM's story (rft, v3 drift)

``--champion-cache`` reuses a champion an earlier run made there (the SFT takes minutes and
is the same for the same settings); without it the wall time includes making the champion.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.demo.options import MODEL_DEFAULTS, DemoOptions
from services.demo.report import DemoReport, format_report
from services.demo.run import run_demo
from services.evaluation.figures import Gain, Rate
from services.local.stack import stop_children_on_signals
from services.settings import load_settings


def uncertainty_figures(report: DemoReport) -> dict[str, Any]:
    """Every headline with its counts and 95 % interval (services.evaluation.figures):
    live success before and after (Wilson) and its change (Newcombe), the held-out gain
    behind the points (paired bootstrap), each cycle's three numbers, and the report's notes
    (a held-out interval wider than ±15 points says so)."""

    def figure(value: Gain | Rate | None) -> dict[str, Any] | None:
        return value.to_json() if value is not None else None

    return {
        "live_success_before_figure": figure(report.live_before),
        "live_success_after_figure": figure(report.live_after),
        "live_change": figure(report.live_change),
        "heldout_gain": figure(report.heldout_gain),
        "cycle_figures": [
            {
                "cycle": row.number,
                "heldout": figure(row.heldout),
                "gate": figure(row.gate),
                "live": figure(row.live_delta),
            }
            for row in report.cycles
        ],
        "notes": report.notes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--drift-at", type=float, default=45.0)
    parser.add_argument("--traffic", type=float, default=4.0)
    parser.add_argument(
        "--traffic-workers",
        type=int,
        default=None,
        help="simulated users at once (the model's default: 2, 8 for smollm2)",
    )
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--champion-cache", type=Path, default=None)
    parser.add_argument(
        "--model",
        choices=tuple(MODEL_DEFAULTS),
        default="tiny",
        help="the champion, as `ratchet demo --model` (smollm2: the v3 drift, 2 hours at most)",
    )
    args = parser.parse_args()
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="ratchet-loop-bench-"))
    options = DemoOptions.for_model(
        args.model,
        cycles=args.cycles,
        drift_at=args.drift_at,
        traffic=args.traffic,
        traffic_workers=args.traffic_workers,
        state_dir=state_dir,
        champion_cache=args.champion_cache,
    )
    # SIGTERM (timeout, CI) and Ctrl-C stop the whole stack the run started.
    with stop_children_on_signals():
        report = run_demo(options, load_settings(), out=lambda line: print(line, flush=True))
    print(format_report(report), flush=True)
    figures = {
        "model": args.model,
        "promotions": report.promotions,
        "live_success_before": report.live_success_before,
        "live_success_after": report.live_success_after,
        "demo_wall_s": round(report.demo_wall_s, 1),
        "orchestration_overhead_frac": report.orchestration_overhead_frac,
        "cycles": len(report.cycles),
        "traces_posted": report.traces_posted,
        "cost_usd": sum(row.cost_usd for row in report.cycles),
        "points_gained": sum(row.points for row in report.cycles),
        "heldout_points_gained": report.heldout_points_gained,
        "gate_points": report.gate_points,
        "live_points_gained": report.live_points_gained,
        "usd_per_heldout_point": report.usd_per_heldout_point,
        "canary_window_s": round(report.canary_window_s, 1),
        "estimate_usd": report.estimate_usd,
        "actual_usd": report.actual_usd,
        "cost_by_phase": report.cost_by_phase,
        "cycle_wall_s": report.cycle_wall_s,
        "champion_note": report.champion_note,
        "tokens_served": report.tokens_served,
        "serving_usd_per_mtok": report.serving_usd_per_mtok,
        **uncertainty_figures(report),
    }
    print(json.dumps(figures))
    return 0 if report.cycles else 1


if __name__ == "__main__":
    sys.exit(main())
