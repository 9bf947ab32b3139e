"""Settings: embedded defaults, RATCHET_* variables, a TOML file, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.settings import SettingsError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("RATCHET_"):
            monkeypatch.delenv(key)


def test_defaults_are_the_embedded_stack() -> None:
    settings = load_settings()
    assert settings.state_dir == Path("~/.ratchet").expanduser()
    assert settings.uses_embedded_postgres and settings.uses_embedded_temporal
    assert settings.effective_temporal_address == "127.0.0.1:7233"
    assert settings.effective_temporal_ui_url == "http://127.0.0.1:8233"
    assert (settings.api_host, settings.api_port) == ("127.0.0.1", 8000)
    assert settings.artifacts_dir == settings.state_dir / "artifacts"


def test_environment_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("RATCHET_DATABASE_URL", "postgres://u:p@db:5432/ratchet")
    monkeypatch.setenv("RATCHET_TEMPORAL_ADDRESS", "temporal:7233")
    monkeypatch.setenv("RATCHET_TEMPORAL_PORT", "17233")
    monkeypatch.setenv("RATCHET_API_PORT", "9000")
    settings = load_settings()
    assert settings.state_dir == tmp_path
    assert settings.sqlalchemy_url() == "postgresql+psycopg://u:p@db:5432/ratchet"
    assert settings.effective_temporal_address == "temporal:7233"
    assert settings.effective_temporal_ui_url is None
    assert settings.api_port == 9000


def test_config_file_with_environment_winning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "ratchet.toml"
    config.write_text('api_port = 9100\ntemporal_namespace = "ml"\n')
    monkeypatch.setenv("RATCHET_CONFIG_FILE", str(config))
    monkeypatch.setenv("RATCHET_API_PORT", "9200")
    settings = load_settings()
    assert settings.temporal_namespace == "ml"
    assert settings.api_port == 9200


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("RATCHET_DATABASE_URL", "mysql://x", "RATCHET_DATABASE_URL: must be a Postgres URL"),
        ("RATCHET_API_PORT", "99999", "RATCHET_API_PORT"),
        ("RATCHET_API_PORT", "eighty", "RATCHET_API_PORT"),
        ("RATCHET_TEMPORAL_ADDRESS", "no-port", "RATCHET_TEMPORAL_ADDRESS: must be host:port"),
        ("RATCHET_LOG_FORMAT", "xml", "RATCHET_LOG_FORMAT"),
        ("RATCHET_EXECUTOR", "slurm", "RATCHET_EXECUTOR"),
        (
            "RATCHET_PARTITION_PERIOD",
            "monthly",
            "RATCHET_PARTITION_PERIOD: Input should be 'daily' or 'weekly' (got 'monthly')",
        ),
        (
            "RATCHET_PARTITIONS_AHEAD",
            "0",
            "RATCHET_PARTITIONS_AHEAD: Input should be greater than or equal to 1 (got '0')",
        ),
    ],
)
def test_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as error:
        load_settings()
    message = str(error.value)
    assert expected in message
    assert "\n" not in message


def test_missing_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RATCHET_CONFIG_FILE", str(tmp_path / "absent.toml"))
    with pytest.raises(SettingsError, match="RATCHET_CONFIG_FILE"):
        load_settings()


def test_broken_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "ratchet.toml"
    config.write_text("api_port = [\n")
    monkeypatch.setenv("RATCHET_CONFIG_FILE", str(config))
    with pytest.raises(SettingsError, match="cannot read settings"):
        load_settings()


def test_serving_endpoints_come_from_json_with_their_kind_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "RATCHET_SERVING_ENDPOINTS",
        '{"vllm": {"kind": "openai", "url": "http://vllm:8000/", "api_key": "k1"},'
        ' "prod": {"kind": "kubernetes", "url": "http://prod:8000", "deployment": "prod",'
        ' "container": "vllm", "artifacts_dir": "/artifacts"}}',
    )
    endpoints = load_settings().serving_endpoints
    assert endpoints["vllm"].url == "http://vllm:8000"
    assert endpoints["vllm"].api_key is not None
    assert endpoints["vllm"].api_key.get_secret_value() == "k1"
    prod = endpoints["prod"]
    assert (prod.deployment, prod.container, prod.env_var) == ("prod", "vllm", "RATCHET_MODEL_PATH")
    assert prod.namespace is None  # RATCHET_KUBERNETES_NAMESPACE


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ('{"kind": "Not A Kind", "url": "http://p:8000"}', "kind"),
        ('{"kind": "openai", "url": "ftp://p"}', "http"),
        ('{"kind": "kubernetes", "url": "http://p", "deployment": "Bad_Name"}', "deployment"),
        ('{"kind": "openai", "url": "http://p", "token": "x"}', "token"),
    ],
)
def test_bad_serving_endpoints_name_the_entry_and_never_show_its_key(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, message: str
) -> None:
    key = "do-not-print-this-key"
    spliced = endpoint[:-1] + f', "api_key": "{key}"}}'
    monkeypatch.setenv("RATCHET_SERVING_ENDPOINTS", f'{{"vllm": {spliced}}}')
    with pytest.raises(SettingsError) as refused:
        load_settings()
    text = str(refused.value)
    assert "RATCHET_SERVING_ENDPOINTS (vllm" in text and message in text
    assert key not in text


def test_an_endpoints_kind_is_a_name_the_serving_registry_judges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settings are the bottom layer: they do not know which kinds exist, nor what each kind
    needs (tests/services/serving/test_endpoint_kinds.py: the api and the worker refuse)."""
    monkeypatch.setenv(
        "RATCHET_SERVING_ENDPOINTS",
        '{"a": {"kind": "ssh", "url": "http://a"}, "b": {"kind": "kubernetes", "url": "http://b"}}',
    )
    endpoints = load_settings().serving_endpoints
    assert (endpoints["a"].kind, endpoints["b"].deployment) == ("ssh", None)


def test_tool_endpoints_are_http_or_mcp_with_an_allow_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "RATCHET_TOOL_ENDPOINTS",
        '{"orders": {"url": "http://orders/call/", "api_key": "k", "tools": ["b", "a", "a"]},'
        ' "desk": {"kind": "mcp", "command": ["desk-tools", "--stdio"], "tools": ["gate"],'
        ' "timeout_s": 5, "requests_per_minute": 10, "max_result_bytes": 1024},'
        ' "airport": {"kind": "mcp", "url": "https://tools/mcp", "tools": ["flight_status"]}}',
    )
    endpoints = load_settings().tool_endpoints
    orders, desk = endpoints["orders"], endpoints["desk"]
    assert (orders.kind, orders.url, orders.tools) == ("http", "http://orders/call", ["a", "b"])
    assert (orders.timeout_s, orders.requests_per_minute, orders.max_result_bytes) == (
        30.0,
        60.0,
        65_536,
    )
    assert (desk.kind, desk.command, desk.url) == ("mcp", ["desk-tools", "--stdio"], None)
    assert endpoints["airport"].url == "https://tools/mcp"


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ('{"url": "http://t"}', "tools"),  # the allow-list is required
        ('{"url": "http://t", "tools": []}', "tools"),
        ('{"url": "http://t", "tools": ["drop table"]}', "tool names must match"),
        ('{"kind": "http", "command": ["x"], "tools": ["a"]}', "needs a url"),
        ('{"kind": "mcp", "tools": ["a"]}', "a url (streamable HTTP) or a command"),
        ('{"kind": "mcp", "url": "http://t", "command": ["x"], "tools": ["a"]}', "or a command"),
        ('{"kind": "mcp", "command": ["x"], "tools": ["a"], "api_key": "k"}', "takes no api_key"),
        ('{"kind": "grpc", "url": "http://t", "tools": ["a"]}', "kind"),
        ('{"url": "ftp://t", "tools": ["a"]}', "http"),
        ('{"url": "http://t", "tools": ["a"], "timeout_s": 0}', "timeout_s"),
        ('{"url": "http://t", "tools": ["a"], "max_result_bytes": 0}', "max_result_bytes"),
        ('{"url": "http://t", "tools": ["a"], "allow": "all"}', "allow"),
    ],
)
def test_bad_tool_endpoints_name_the_entry_and_never_show_their_key(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, message: str
) -> None:
    key = "do-not-print-this-key"
    monkeypatch.setenv("RATCHET_TOOL_ENDPOINTS", f'{{"orders": {endpoint}}}')
    monkeypatch.setenv(
        "RATCHET_JUDGE_ENDPOINTS", f'{{"g": {{"url": "http://g", "api_key": "{key}"}}}}'
    )
    with pytest.raises(SettingsError) as refused:
        load_settings()
    text = str(refused.value)
    assert "RATCHET_TOOL_ENDPOINTS (orders" in text and message in text
    assert "value hidden" in text and key not in text
