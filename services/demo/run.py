"""`ratchet demo`: the whole story on one machine, with real parts.

1. Start the embedded stack (Postgres, Temporal dev server, api, worker) in a fresh state
   directory on free ports.
2. Make the first champion: an SFT job on toolcalc v1 demonstrations.
3. Serve it with the local model server (`ratchet serve`).
4. Create a loop whose serving target is that server, register the champion, start the loop.
5. Simulated production traffic posts signed traces; at ``drift_at`` seconds the tool API
   drifts (v1 → v2) and the champion starts failing.
6. The loop curates the failures, trains a candidate from the champion (GRPO), evaluates both
   on the same eval tasks (new failures), the regression suite and the frozen held-out set,
   promotes on a significant win, watches the canary, and the live success rate recovers.
7. Print a table per cycle — the three numbers: held-out points gained (the headline, and
   the $ per point), the gate's points on new failures, the live delta after the canary —
   and the live success rate over time, read from the traces in Postgres with the query
   the canary uses.

The toy champion is pre-exposed to v2's names: ``augment_fraction`` of its SFT
demonstrations show v2's deprecation window (old names mostly, some new), and v1 accepts
v2's names as aliases, so GRPO only has to amplify what sampling already finds. Every
report says so; it is not a measurement of learning a drift from nothing.

This module puts the story together; each part has its own: the stack's settings
(:mod:`services.demo.stack`), the champion (:mod:`services.demo.champion`), the model
server (:mod:`services.demo.server`), the traffic (:mod:`services.demo.traffic`), the
watcher (:mod:`services.demo.watcher`) and the report (:mod:`services.demo.report`).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from functools import partial
from typing import Any

from pydantic import SecretStr

from services.client import LoopPolicies, RatchetClient
from services.db.queries.loops import require_loop
from services.db.session import create_db_engine, make_session_factory
from services.demo.champion import champion_note, make_demo_champion
from services.demo.options import LOOP_NAME, DemoOptions, Printer
from services.demo.report import DemoReport, build_report
from services.demo.server import start_model_server, stop_model_server
from services.demo.stack import demo_settings, stack_database_url
from services.demo.traffic import ServedModel, TraceDestination, TrafficSimulator
from services.demo.watcher import watch
from services.executors.local import kill_local_jobs
from services.local.stack import Stack
from services.modelserver.attestation import TraceAttestation, attestation_key, attested
from services.settings import Settings


def run_demo(options: DemoOptions, base: Settings, out: Printer = print) -> DemoReport:
    settings = demo_settings(options, base)
    token = secrets.token_urlsafe(24)
    wall_started = time.monotonic()
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    out(f"[demo] state in {settings.state_dir}")
    # The model server gets a key of its own: the admin token never goes to a model server.
    settings = settings.model_copy(
        update={
            "admin_token": SecretStr(token),
            "serve_api_key": SecretStr(secrets.token_urlsafe(24)),
            "serve_admin_key": SecretStr(secrets.token_urlsafe(24)),
            "serve_attestation_key": SecretStr(secrets.token_urlsafe(32)),
        }
    )
    stack = Stack(settings, extra_env={"RATCHET_ADMIN_TOKEN": token})
    server: subprocess.Popen[bytes] | None = None
    traffic: TrafficSimulator | None = None
    try:
        stack.preflight()
        stack.start_servers()
        stack.migrate()
        stack.start_children(log_to_files=True)
        stack.wait_api_ready()
        out(
            f"[demo] Ratchet is up: dashboard {settings.api_base_url}/  Temporal UI "
            f"{settings.effective_temporal_ui_url}  logs {settings.logs_dir}"
        )
        champion = make_demo_champion(options, settings, out)
        server = start_model_server(settings, champion)
        client = RatchetClient(settings.api_base_url, token)
        created = client.create_loop(LOOP_NAME, "toolcalc", policies=loop_policies(options))
        client.set_champion(LOOP_NAME, str(champion))
        client.start_loop(LOOP_NAME)
        api_version = ["v1"]
        traffic = TrafficSimulator(
            served=served_model(options, settings),
            destination=TraceDestination(
                api_url=settings.api_base_url,
                loop=LOOP_NAME,
                signing_secret=created.signing_secret,
            ),
            api_version=lambda: api_version[0],
            rate_per_s=options.traffic,
            workers=options.traffic_workers,
        )
        traffic.start()
        out(
            f"[demo] production traffic: {options.traffic:g} traces/s from "
            f"{options.traffic_workers} users on tool API v1"
        )
        report = _watch_and_report(options, settings, traffic, api_version, out)
        report.demo_wall_s = time.monotonic() - wall_started
        report.champion_note = champion_note(options)
        return report
    finally:
        if traffic is not None:
            traffic.stop()
        if server is not None:
            stop_model_server(server)
        stack.stop()
        kill_local_jobs(settings.artifacts_dir)


def loop_policies(options: DemoOptions) -> LoopPolicies:
    """The demo loop's policies: served by the local model server, a cycle once
    ``min_new_tasks`` new tasks are curated (no drift trigger), the demo's canary, and the
    training profile of the demo's model."""
    return LoopPolicies(
        serving_target={"kind": "local"},
        trigger_policy={
            "min_new_tasks": options.min_new_tasks,
            "check_interval_s": 2,
            "drift_enabled": False,
        },
        gate_policy={
            **served_sampling(options.traffic_temperature),
            "canary_seconds": options.canary_seconds,
            "canary_check_interval_s": 3,
            "canary_min_traces": 20,
            # The demo's regression suite (the sampled v1 successes of eval-hashed clusters,
            # about a fifth of them) holds ten-odd tasks, so one task is 5-10 points: a
            # tighter tolerance would refuse any candidate that misses a single one.
            "regression_tolerance_points": 10,
        },
        training_profile=_training_profile(options),
        curation_policy=dict(options.curation_policy),
    )


def served_model(options: DemoOptions, settings: Settings) -> ServedModel:
    """The demo's model server as its agents call it: the family's conversation style and
    the demo's sampling temperature (which its gate evaluates at: :func:`served_sampling`)."""
    assert settings.serve_api_key is not None
    return ServedModel(
        url=f"http://{settings.serve_host}:{settings.serve_port}",
        api_key=settings.serve_api_key.get_secret_value(),
        style="chat" if options.model == "smollm2" else "transcript",
        temperature=options.traffic_temperature,
    )


def _attested(settings: Settings) -> TraceAttestation | None:
    """How the canary tells the traces the demo's model server served (it signs them with
    the demo's attestation key), so the report counts live success as the canary does."""
    key = attestation_key(settings)
    return partial(attested, key=key) if key is not None else None


def served_sampling(temperature: float) -> dict[str, Any]:
    """The gate policy's evaluation sampling for traffic served at ``temperature``: the same
    temperature, so the eval, regression and held-out pass rates measure what the agent
    gets; greedy decoding is one sample per task (every sample would be the same), sampled
    decoding four."""
    return {"eval_temperature": temperature, "eval_samples": 4 if temperature > 0 else 1}


def _training_profile(options: DemoOptions) -> dict[str, Any]:
    if options.model == "smollm2":
        from services.demo import smollm2

        return smollm2.training_profile()
    return {"algorithm": "grpo", "hyperparameters": options.grpo_hyperparameters}


def _watch_and_report(
    options: DemoOptions,
    settings: Settings,
    traffic: TrafficSimulator,
    api_version: list[str],
    out: Printer,
) -> DemoReport:
    engine = create_db_engine(stack_database_url(settings), pool_size=2, application="ratchet-demo")
    sessions = make_session_factory(engine)
    try:
        watched = watch(options, sessions, traffic, api_version, out)
        with sessions() as session:
            return build_report(
                session,
                loop=require_loop(session=session, name=LOOP_NAME),
                live=watched.live,
                drift_at=watched.drift_at,
                drift_wall=watched.drift_wall,
                traces_posted=traffic.stats.posted,
                state_dir=str(settings.state_dir),
                attested=_attested(settings),
            )
    finally:
        engine.dispose()
