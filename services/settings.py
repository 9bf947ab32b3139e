"""Ratchet's one settings object.

This is the only module that reads ``os.environ`` (jobs excepted: they read the job
contract's variables). Every setting is a ``RATCHET_*`` environment variable and may also be
given in a TOML config file named by ``RATCHET_CONFIG_FILE`` (environment wins). Defaults are
the embedded stack: a Postgres and a Temporal dev server under the state directory.

Settings load lazily through :func:`get_settings` and fail fast with one clear line
(:class:`SettingsError`) naming the variable at fault, so the CLI can print it without a
traceback.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from services.cores import usable_cores

ENV_PREFIX = "RATCHET_"


class SettingsError(Exception):
    """A setting is missing or wrong; the message names it and says what to do."""


def _config_file_from_env() -> Path | None:
    raw = os.environ.get(f"{ENV_PREFIX}CONFIG_FILE")
    return Path(raw).expanduser() if raw else None


class Endpoint(BaseModel):
    """An HTTP endpoint the deployment lets Ratchet call, under a name.

    A loop names an endpoint; it never supplies a URL or a credential of its own. That way a
    person who may edit a loop cannot make the worker send a key (or anything else) to a host
    the operator did not list. Given as JSON, e.g. ``RATCHET_JUDGE_ENDPOINTS='{"gpt": {"url":
    "https://api.example.com/v1", "api_key": "..."}}'``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(min_length=1, max_length=2048)
    api_key: SecretStr | None = None
    timeout_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("url", mode="after")
    @classmethod
    def _check_url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in {"http", "https"} or not rest.strip("/"):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")


# A tool's name as an agent's tools list it (OpenAI function names; MCP tool names).
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class ToolEndpoint(BaseModel):
    """A live tool server a replay loop may send the calls nobody recorded to, under a name.

    Either Ratchet's own HTTP shape (``kind: http``: ``POST <url>`` with ``{"name",
    "arguments"}``) or an MCP server (``kind: mcp``): streamable HTTP at ``url``, or, for the
    local stack, a stdio ``command`` (an argv list) the job starts. Tool names come from
    traces, so the operator says which ones this endpoint may be asked (``tools``, the
    allow-list): any other call gets the sandbox's "no recorded result" answer and never
    reaches the server. An endpoint must be free of side effects (or a staging copy): the
    policy being trained, not a person, chooses the calls. Each process paces its calls
    (``requests_per_minute``), gives each one ``timeout_s`` and refuses a result over
    ``max_result_bytes`` with an error text. Given as JSON in ``RATCHET_TOOL_ENDPOINTS``,
    e.g. ``{"airport": {"kind": "mcp", "command": ["airport-tools", "--stdio"], "tools":
    ["gate_walk_minutes", "flight_status"]}}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["http", "mcp"] = "http"
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    command: list[str] | None = Field(default=None, min_length=1, max_length=64)
    api_key: SecretStr | None = None
    tools: list[str] = Field(min_length=1, max_length=1024)
    timeout_s: float = Field(default=30.0, gt=0, le=600)
    requests_per_minute: float = Field(default=60.0, gt=0, le=60_000)
    max_result_bytes: int = Field(default=65_536, ge=1, le=16 << 20)

    @field_validator("url", mode="after")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in {"http", "https"} or not rest.strip("/"):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

    @field_validator("command", mode="after")
    @classmethod
    def _check_command(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value[0] or any(len(part) > 4096 for part in value)):
            raise ValueError("must be an argv list whose first item is the program")
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _check_tools(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not re.match(TOOL_NAME, name)]
        if bad:
            raise ValueError(f"tool names must match {TOOL_NAME}; refused: {bad[:3]}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _check_transport(self) -> ToolEndpoint:
        if self.kind == "http" and (self.url is None or self.command is not None):
            raise ValueError("an http tool endpoint needs a url and takes no command")
        if self.kind == "mcp" and (self.url is None) == (self.command is None):
            raise ValueError("an mcp tool endpoint needs a url (streamable HTTP) or a command")
        if self.command is not None and self.api_key is not None:
            raise ValueError("a stdio command takes no api_key (nothing would carry it)")
        return self


# Names Kubernetes gives objects and containers (DNS-1123 labels), and environment variables.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


# A serving target kind's name (services.serving.kinds registers the kinds under names like
# this one; an endpoint names the kind of target that deploys to it).
SERVING_KIND_NAME = r"^[a-z][a-z0-9_-]{0,62}$"


class ServingEndpoint(Endpoint):
    """A model server a loop's serving target deploys to, by name (``openai``, ``kubernetes``,
    or any kind that deploys to an endpoint).

    Everything that says where a checkpoint goes and with which credential lives here, in the
    deployment's settings, never in a loop: the URL and API key (vLLM's ``--api-key``) of the
    model servers, where they see the artifact store, and for ``kubernetes`` the Deployment,
    container and environment variable a deploy patches. A person who may edit a loop can
    then only pick one of the servers the operator listed; they cannot send the key elsewhere
    or point a deploy at another Deployment (the worker's own, say). Given as JSON in
    ``RATCHET_SERVING_ENDPOINTS``, e.g. ``{"vllm": {"kind": "kubernetes", "url":
    "http://vllm.serving:8000", "api_key": "...", "namespace": "serving", "deployment":
    "vllm", "container": "vllm", "artifacts_dir": "/artifacts"}}``.

    Settings are the bottom layer and do not know which kinds exist: ``kind`` is only a name
    here. Whether it is a registered kind, and the fields that kind needs or refuses (a
    ``kubernetes`` endpoint needs ``deployment``), are the kind's entry in
    :mod:`services.serving.kinds`, which the api and the worker check when they start.
    """

    kind: str = Field(pattern=SERVING_KIND_NAME)
    # Where the model server sees Ratchet's artifact store, when it mounts it elsewhere.
    artifacts_dir: str | None = Field(default=None, min_length=1, max_length=1024)
    # kubernetes: the Deployment of model servers; namespace defaults to
    # RATCHET_KUBERNETES_NAMESPACE, container to the only one.
    namespace: str | None = Field(default=None, pattern=_DNS_LABEL)
    deployment: str | None = Field(default=None, pattern=_DNS_SUBDOMAIN)
    container: str | None = Field(default=None, pattern=_DNS_LABEL)
    env_var: str = Field(default="RATCHET_MODEL_PATH", pattern=_ENV_NAME)
    rollout_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    # The server signs its response ids with RATCHET_SERVE_ATTESTATION_KEY (it is a
    # `ratchet serve` given this deployment's key): the canary then counts only the traces
    # it served, by the server's word (services/modelserver/attestation.py).
    attests: bool = False


class Settings(BaseSettings):
    """Everything a Ratchet process may be configured with."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        validate_default=True,
    )

    # Where the embedded stack keeps its data, logs and artifacts.
    state_dir: Path = Field(default=Path("~/.ratchet"))
    config_file: Path | None = None

    # Postgres. Unset means: the embedded pgserver under the state directory.
    database_url: str | None = None
    database_pool_size: int = Field(default=10, ge=1, le=200)

    # Temporal. Unset address means: the embedded dev server on temporal_port.
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    temporal_task_queue: str = "ratchet"
    temporal_port: int = Field(default=7233, ge=1, le=65535)
    temporal_ui_port: int = Field(default=8233, ge=1, le=65535)
    temporal_tls: bool = False
    temporal_tls_ca_cert: Path | None = None
    temporal_tls_client_cert: Path | None = None
    temporal_tls_client_key: Path | None = None
    temporal_api_key: SecretStr | None = None

    # HTTP.
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    # Processes of `ratchet api` on one port, each with its own ingest writer (one Postgres
    # connection) and credential cache; more than one uses the machine's other cores.
    # Default: the cores this process may use (affinity and cgroup CPU quota), at most 64.
    api_workers: int = Field(default_factory=lambda: min(usable_cores(), 64), ge=1, le=64)
    # Bodies outside the ingest doors (admin API, dashboard) are refused past this size
    # before they are parsed or authenticated; ingest has its own limit below.
    api_max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    # Connections served at once per api process (more get a 503 from uvicorn), and how
    # long an idle keep-alive connection is held open.
    api_limit_concurrency: int = Field(default=2048, ge=1)
    api_timeout_keep_alive_s: int = Field(default=5, ge=1, le=600)
    # /metrics on a port of its own (the chart sets one); unset serves it on the api port.
    api_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    worker_host: str = "127.0.0.1"
    worker_port: int = Field(default=8001, ge=1, le=65535)
    # Jobs one worker follows at once (a run_job activity waits for its job, hours perhaps),
    # in slots of their own: never the slots of the database and curation activities every
    # loop's cycle needs, so many loops' long jobs never starve another loop's cycle.
    worker_max_jobs: int = Field(default=256, ge=1, le=10_000)
    public_url: str | None = None
    temporal_ui_url: str | None = None

    # Security.
    admin_token: SecretStr | None = None
    # Fernet keys (comma-separated, newest first) that encrypt stored signing secrets; unset
    # means a generated key in <state_dir>/secret.key (the embedded stack). See services.secrets.
    secret_key: SecretStr | None = None

    # Artifacts (datasets, checkpoints, job outputs). Unset means <state_dir>/artifacts.
    artifact_root: Path | None = None

    # Logging.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["auto", "json", "text"] = "auto"

    # Jobs.
    executor: Literal["local", "kubernetes"] = "local"
    kubernetes_namespace: str = "default"
    kubernetes_job_template: Path | None = None
    kubernetes_in_cluster: bool = False
    job_python: str | None = None
    accelerator_hour_price_usd: float = Field(default=2.5, ge=0)
    cpu_hour_price_usd: float = Field(default=0.04, ge=0)

    # A loop's own job command (training_profile.train_job / eval_job) on the local
    # executor. Off: such a loop is refused, since the command would run as the worker's
    # user on the worker's machine (the kubernetes executor runs it in the loop's image).
    local_job_commands_enabled: bool = False
    # Jobs the local executor runs at once on this machine; the rest wait in a queue fair
    # between loops (services.executors.local_queue). 0: no limit.
    local_max_jobs: int = Field(default=2, ge=0, le=1024)

    # Ingestion.
    ingest_max_body_bytes: int = Field(default=5 * 1024 * 1024, ge=1024)
    ingest_max_batch: int = Field(default=500, ge=1)
    ingest_timestamp_tolerance_s: int = Field(default=300, ge=1)
    ingest_queue_max: int = Field(default=20_000, ge=1)
    ingest_commit_max_rows: int = Field(default=1_000, ge=1)
    ingest_commit_max_wait_ms: float = Field(default=2.0, ge=0)
    # OTLP: spans of an unfinished episode wait in Postgres until the episode's span arrives
    # or the trace has been quiet this long; then whatever arrived becomes one trace.
    otlp_episode_quiet_s: float = Field(default=30.0, gt=0, le=86_400)
    # ... and a trace that never goes quiet is assembled this long after its first span.
    otlp_episode_max_wait_s: float = Field(default=3_600.0, gt=0)
    # How long assembled spans keep their ids, so a late or re-exported span is recognised.
    otlp_span_retention_s: int = Field(default=86_400, ge=60)
    # Per export: spans and log records (413 over it), and bytes of one attribute value or
    # log body (the trace or record holding it is rejected).
    otlp_max_spans_per_export: int = Field(default=10_000, ge=1)
    otlp_max_attribute_bytes: int = Field(default=1024 * 1024, ge=1024)

    # Raw trace bodies are purged this many days after they arrive (tasks keep their redacted
    # copies, rows keep their ids and outcomes); 0 keeps them for ever.
    trace_retention_days: int = Field(default=30, ge=0)
    # Trace bodies and OTLP span payloads live in tables partitioned by the time they arrived
    # (services.db.partitions): one partition per UTC day or ISO week, made this many
    # periods ahead by the worker's retention schedule and retired whole by retention.
    partition_period: Literal["daily", "weekly"] = "daily"
    partitions_ahead: int = Field(default=3, ge=1, le=366)

    # Demonstrations (services.curation.demonstrations): the verified episodes kept per task,
    # with their tokens, from probes and training runs: at most this many successes and as
    # many failures of each task (the newest); a job is asked to keep as many. 0 keeps none.
    demonstrations_per_task: int = Field(default=16, ge=0, le=1024)

    # Curation: processes that share a batch's per-trace work (this one included).
    # Default: the cores this process may use (affinity and cgroup CPU quota), at most 64.
    curation_processes: int = Field(default_factory=lambda: min(usable_cores(), 64), ge=1, le=64)

    # Named endpoints a loop may call by name: live tools for the replay environment (see
    # ToolEndpoint: HTTP or MCP, each with its allow-list of tool names), and
    # OpenAI-compatible LLM judges (see Endpoint).
    tool_endpoints: dict[str, ToolEndpoint] = Field(default_factory=dict)
    judge_endpoints: dict[str, Endpoint] = Field(default_factory=dict)

    # Local serving target (the built-in model server).
    serve_host: str = "127.0.0.1"
    serve_port: int = Field(default=8100, ge=1, le=65535)
    # The model server's inference key (vLLM's --api-key): `ratchet serve` requires it as a
    # Bearer token on every route but the health checks when set; it serves, it never swaps
    # (the adapter routes refuse it). Agents, and whatever only samples, hold it. It is never
    # the admin token: no credential of the control plane is sent to a model server.
    serve_api_key: SecretStr | None = None
    # The model server's admin key: the only key `POST /v1/load_lora_adapter` and
    # `/v1/unload_lora_adapter` accept (it serves too). The worker holds it, and sends it to
    # the local model server it deploys to; agents never get it.
    serve_admin_key: SecretStr | None = None
    # Signs each response id of `ratchet serve` for the checkpoint that answered, so the
    # canary counts a trace for the version the server names, not the one the agent reports
    # (services/modelserver/attestation.py). The worker sends it to the model servers it starts
    # (the local stack keeps one in <state_dir>); agents never get it.
    serve_attestation_key: SecretStr | None = None
    # `ratchet serve` under careless or hostile clients: request bodies past this size are
    # refused (413) before they are parsed, and past this many rows waiting to decode a
    # request is answered 429 with Retry-After instead of queued.
    serve_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    serve_queue_max: int = Field(default=256, ge=1)
    # LoRA adapters `ratchet serve` keeps loaded (vLLM's --max-cpu-loras): past it the least
    # recently requested one is unloaded and stays registered, loaded again on its next
    # request (services/modelserver/registry.py). One loop per agent registers one or more
    # adapters each; this bounds their memory. 0: no limit.
    serve_max_adapters: int = Field(default=32, ge=0, le=100_000)
    # Directories `POST /v1/load_lora_adapter` may load checkpoints from (absolute; the path
    # must lie inside one, symlinks refused). Empty: the artifact store and the directory
    # holding the checkpoint `ratchet serve` started with.
    serve_model_roots: list[Path] = Field(default_factory=list)
    # The model servers that serving targets deploy to (`openai`, `kubernetes`), by name (see
    # ServingEndpoint): a loop's serving target names one; each carries its own API key.
    serving_endpoints: dict[str, ServingEndpoint] = Field(default_factory=dict)
    # The model server every job of this deployment rolls out on (docs/deploy.md, "Rollouts
    # on vLLM"): one of serving_endpoints, by name, and the base model it serves. The worker
    # hands each job the endpoint's URL, this model and a shared directory of the run's own,
    # and the endpoint's key as a credential (a Secret of the run's own on Kubernetes). Unset:
    # jobs roll out in the job.
    rollout_endpoint: str | None = Field(default=None, min_length=1, max_length=253)
    rollout_model: str | None = Field(default=None, min_length=1, max_length=256)
    # The serving ledger's prices (services.loop.ledger): an hour of the serving hardware,
    # charged per busy compute-second, and what a cached prompt token weighs against a
    # computed one (0..1) when that cost is shared over the tokens served.
    serving_hour_price_usd: float = Field(default=2.5, ge=0)
    serving_cached_token_weight: float = Field(default=0.1, ge=0, le=1)
    # How often the worker's schedule samples every serving loop's counters between deploys
    # (workflows/ledger.py); 0 turns the schedule off (deploys and cycle closes still sample).
    serving_ledger_sample_s: int = Field(default=300, ge=0, le=86_400)

    # Capture gateway (`ratchet gateway`, services.gateway): the OpenAI-compatible proxy an
    # agent's base_url points at; its calls become traces.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8200, ge=1, le=65535)
    # The gateway's URL as agents reach it (shown by `loop create` and the docs' snippets).
    gateway_public_url: str | None = None
    # The local spool captured calls wait in until they are in Postgres; unset:
    # <state_dir>/gateway-spool. One directory per replica (the chart gives each pod its own).
    gateway_spool_dir: Path | None = None
    # Past this many bytes waiting, calls are still answered but no longer captured
    # (counted in ratchet_gateway_dropped_total).
    gateway_spool_max_bytes: int = Field(default=512 * 1024 * 1024, ge=64 * 1024)
    # The group commit's window: the spool is fsync'd at most this long after a call was
    # written (what a power cut can lose; a killed process loses nothing).
    gateway_spool_fsync_ms: float = Field(default=20.0, ge=1, le=10_000)
    # Request bodies past this size are refused (413) before they are read.
    gateway_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A session with no call for this long closes and becomes a trace.
    gateway_session_idle_s: float = Field(default=300.0, gt=0, le=7 * 86_400)
    # How long the gateway waits on an upstream for an answer (or the next streamed event).
    gateway_upstream_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    # How often each replica re-reads the loops' gateway keys and routes (a new key is read
    # at once; a revoked one stops working within this).
    gateway_key_refresh_s: float = Field(default=5.0, gt=0, le=3_600)
    # OpenAI-compatible upstreams a loop may name (serving_target.upstream), each with the
    # key Ratchet holds for it (agents never see it), e.g. '{"openai": {"url":
    # "https://api.openai.com/v1", "api_key": "..."}}'.
    gateway_upstreams: dict[str, Endpoint] = Field(default_factory=dict)
    # /metrics on a port of its own (the chart sets one); unset serves it on the gateway port.
    gateway_metrics_port: int | None = Field(default=None, ge=1, le=65535)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = _config_file_from_env()
        if config_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    @field_validator(
        "state_dir", "artifact_root", "kubernetes_job_template", "gateway_spool_dir", mode="after"
    )
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("database_url", mode="after")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme not in {"postgres", "postgresql", "postgresql+psycopg"}:
            raise ValueError("must be a Postgres URL such as postgresql://user:pass@host:5432/db")
        return value

    @field_validator("secret_key", mode="after")
    @classmethod
    def _check_secret_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        from services.secret_keys import parse_keys  # cryptography: loaded when a key is set

        parse_keys(value.get_secret_value())
        return value

    @field_validator("temporal_address", mode="after")
    @classmethod
    def _check_temporal_address(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError("must be host:port, for example temporal-frontend:7233")
        return value

    @model_validator(mode="after")
    def _check_rollout_endpoint(self) -> Settings:
        if self.rollout_endpoint is None:
            return self
        if self.rollout_endpoint not in self.serving_endpoints:
            listed = ", ".join(sorted(self.serving_endpoints)) or "none"
            raise ValueError(
                f"RATCHET_ROLLOUT_ENDPOINT names {self.rollout_endpoint!r}, which is not one "
                f"of RATCHET_SERVING_ENDPOINTS ({listed})"
            )
        if self.rollout_model is None:
            raise ValueError(
                "RATCHET_ROLLOUT_MODEL must name the base model the rollout endpoint serves "
                "when RATCHET_ROLLOUT_ENDPOINT is set"
            )
        return self

    # Derived locations -------------------------------------------------------------------

    @property
    def artifacts_dir(self) -> Path:
        return (
            self.artifact_root if self.artifact_root is not None else self.state_dir / "artifacts"
        )

    @property
    def effective_gateway_spool_dir(self) -> Path:
        return self.gateway_spool_dir or self.state_dir / "gateway-spool"

    @property
    def gateway_base_url(self) -> str:
        """Where agents point ``base_url`` (without the ``/v1``)."""
        return (
            self.gateway_public_url or f"http://{self.gateway_host}:{self.gateway_port}"
        ).rstrip("/")

    @property
    def embedded_postgres_dir(self) -> Path:
        return self.state_dir / "postgres"

    @property
    def embedded_temporal_db(self) -> Path:
        return self.state_dir / "temporal" / "temporal.db"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def uses_embedded_postgres(self) -> bool:
        return self.database_url is None

    @property
    def uses_embedded_temporal(self) -> bool:
        return self.temporal_address is None

    @property
    def effective_temporal_address(self) -> str:
        return self.temporal_address or f"127.0.0.1:{self.temporal_port}"

    @property
    def api_base_url(self) -> str:
        return self.public_url or f"http://{self.api_host}:{self.api_port}"

    @property
    def effective_temporal_ui_url(self) -> str | None:
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        if self.uses_embedded_temporal:
            return f"http://127.0.0.1:{self.temporal_ui_port}"
        return None

    def sqlalchemy_url(self, database_url: str | None = None) -> str:
        """The URL in the form SQLAlchemy's psycopg 3 dialect wants."""
        url = database_url or self.database_url
        if url is None:
            raise SettingsError(
                "RATCHET_DATABASE_URL is not set and no embedded Postgres was started; "
                "run `ratchet up` or set RATCHET_DATABASE_URL"
            )
        return to_sqlalchemy_url(url)


def to_sqlalchemy_url(url: str) -> str:
    """postgres:// and postgresql:// become postgresql+psycopg://."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment (and config file), turning errors into one line."""
    config_file = _config_file_from_env()
    if config_file is not None and not config_file.is_file():
        raise SettingsError(
            f"RATCHET_CONFIG_FILE={config_file} does not exist; point it at a TOML file or unset it"
        )
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_describe_validation_error(exc)) from None
    except ValueError as exc:  # e.g. a broken TOML file
        raise SettingsError(f"cannot read settings: {exc}") from None


def secret_field_names() -> frozenset[str]:
    """Settings whose values must never appear in a message: every SecretStr, every map of
    endpoints (their entries hold API keys), and the database URL (it usually holds a
    password)."""
    secret = {
        name
        for name, info in Settings.model_fields.items()
        if "SecretStr" in str(info.annotation) or "Endpoint" in str(info.annotation)
    }
    return frozenset(secret | {"database_url"})


def _describe_validation_error(exc: ValidationError) -> str:
    parts = []
    hidden = secret_field_names()
    for error in exc.errors():
        if not error["loc"]:  # a rule over several settings names them in its message
            parts.append(error["msg"].removeprefix("Value error, "))
            continue
        top, *inner = (str(item) for item in error["loc"])
        variable = f"{ENV_PREFIX}{top.upper()}" + (f" ({'.'.join(inner)})" if inner else "")
        message = error["msg"].removeprefix("Value error, ")
        shown = "value hidden" if top in hidden else f"got {error.get('input')!r}"
        parts.append(f"{variable}: {message} ({shown})")
    return "invalid setting " + "; ".join(parts)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, loaded on first use."""
    return load_settings()
