"""``ratchet up``'s banner: where everything is, the admin token, and where the logs are.

Printed once the api, the worker and the gateway are ready, so it is the last thing on the
screen; on a terminal their logs go to files (services.local.stack), and the banner's
``Logs`` line says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.settings import Settings


@dataclass(frozen=True)
class UpState:
    """What the banner reports of a started stack beyond its settings."""

    embedded_postgres: bool
    embedded_temporal: bool
    children: tuple[str, ...]
    log_to_files: bool
    generated_admin_token: str | None = None


def logs_line(settings: Settings, up: UpState) -> str:
    """Where the processes' logs go."""
    logs = settings.logs_dir
    temporal = f"; Temporal: {logs / 'temporal.log'}" if up.embedded_temporal else ""
    if up.log_to_files:
        return (
            f"{logs}/{{{','.join(up.children)}}}.log{temporal} (`tail -f` them; `ratchet up "
            "--logs terminal` shows them here)"
        )
    return f"{', '.join(up.children)} on this terminal{temporal}"


def up_banner(settings: Settings, up: UpState) -> str:
    api = f"http://{settings.api_host}:{settings.api_port}"
    lines = [
        "Ratchet is up.",
        f"  Gateway (agents)  {settings.gateway_base_url}/v1  (OpenAI base_url; api_key: the "
        "loop's gateway key)",
        f"  API + webhook     {api}  (OpenAPI: {api}/docs)",
        f"  Loop dashboard    {api}/",
        f"  Metrics           {api}/metrics  and  "
        f"http://{settings.worker_host}:{settings.worker_port}/metrics (worker)",
    ]
    ui = settings.effective_temporal_ui_url
    if ui:
        lines.append(f"  Temporal Web UI   {ui}")
    lines.append(f"  Temporal          {settings.effective_temporal_address}")
    postgres = (
        "embedded, " + str(settings.embedded_postgres_dir) if up.embedded_postgres else "external"
    )
    lines.append(f"  Postgres          {postgres}")
    lines.append(f"  State             {settings.state_dir}")
    lines.append(f"  Logs              {logs_line(settings, up)}")
    if up.generated_admin_token:
        from services.local.admin_token import token_path

        lines.append(
            f"  Admin token       {up.generated_admin_token}  "
            f"(kept in {token_path(settings.state_dir)}; the CLI here finds it)"
        )
    lines.append("Press Ctrl-C to stop.")
    return "\n".join(lines)
