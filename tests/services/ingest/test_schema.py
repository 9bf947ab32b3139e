"""ratchet.trace/v1: the published schema file, compatibility with producers, parser safety."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.environments.base import Rejection, build_trace
from services.environments.toolcalc.env import ToolcalcEnvironment
from services.ingest.errors import IngestError
from services.ingest.schema import (
    MAX_FREE_DEPTH,
    TraceV1,
    depth_exceeded,
    dumps_schema,
    json_schema,
    parse_native,
    validate_trace,
)
from tests.services.api.support import make_trace

REPO = Path(__file__).resolve().parents[3]


def test_the_published_schema_file_is_the_models_schema() -> None:
    assert (REPO / "schemas" / "ratchet.trace.v1.json").read_text() == dumps_schema()
    packaged = resources.files("services.ingest").joinpath("ratchet.trace.v1.json").read_text()
    assert packaged == dumps_schema()


def test_the_schema_validates_what_the_model_accepts() -> None:
    validator = jsonschema.Draft202012Validator(json_schema())
    validator.check_schema(json_schema())
    trace = make_trace()
    validator.validate(trace)
    validator.validate({"traces": [trace, trace]})
    assert not validator.is_valid({**trace, "colour": "blue"})
    assert not validator.is_valid({**trace, "messages": []})


def test_toolcalc_traces_validate_and_round_trip_to_curation() -> None:
    """What the reference environment posts is accepted, and its stored body is curatable."""
    env = ToolcalcEnvironment()
    for task in env.generate_tasks(5, seed=7, api_version="v1"):
        episode = env.demonstration(task)
        trace = build_trace(
            task,
            episode,
            env.verify(task, episode),
            external_id=task.task_id[:16],
            model_version="champion",
            started_at="2026-01-01T00:00:00+00:00",
        )
        stored = validate_trace(trace)
        body = json.loads(stored.body_json)
        assert body["messages"] == [
            {k: v for k, v in m.items() if v is not None or k == "content"}
            for m in trace["messages"]
        ]
        assert not isinstance(env.task_from_trace(body), Rejection)


def test_naive_timestamps_are_utc_and_order_is_checked() -> None:
    stored = validate_trace(make_trace(started_at="2026-01-01T00:00:00", ended_at=None))
    assert stored.started_at is not None and stored.started_at.utcoffset() is not None
    with pytest.raises(IngestError) as caught:
        validate_trace(
            make_trace(started_at="2026-01-02T00:00:00Z", ended_at="2026-01-01T00:00:00Z")
        )
    assert "ended_at is before started_at" in caught.value.fields[0]["message"]


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"messages": [{"role": "user", "tool_calls": [{"id": "a", "name": "b"}]}]}, "messages.0"),
        (
            {"messages": [{"role": "assistant", "token_ids": [1, 2], "logprobs": [0.0]}]},
            "messages.0",
        ),
        ({"messages": [{"role": "assistant", "token_ids": [-1]}]}, "messages.0.token_ids.0"),
        ({"outcome": {"error": {"message": "no kind"}}}, "outcome.error.kind"),
        ({"tools": [{"name": ""}]}, "tools.0.name"),
        ({"tools": [{"name": "x", "parameters": []}]}, "tools.0.parameters"),
    ],
)
def test_schema_rules(change: dict[str, Any], path: str) -> None:
    with pytest.raises(IngestError) as caught:
        validate_trace(make_trace(**change))
    assert path in [f["path"] for f in caught.value.fields]


def test_arguments_may_be_an_object_or_the_raw_string() -> None:
    for arguments in ({"a": 1}, '{"a": 1'):
        message = {
            "role": "assistant",
            "tool_calls": [{"id": "c", "name": "f", "arguments": arguments}],
        }
        trace = TraceV1.model_validate(make_trace(messages=[message]))
        assert trace.messages[0].tool_calls is not None
        assert trace.messages[0].tool_calls[0].arguments == arguments


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=150, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries({"traces": st.lists(json_values, max_size=3)}),
        st.builds(
            lambda extra: {**make_trace("x"), **extra},
            st.dictionaries(
                st.sampled_from(
                    [
                        "messages",
                        "outcome",
                        "tools",
                        "metadata",
                        "started_at",
                        "schema",
                        "external_id",
                    ]
                ),
                json_values,
                max_size=3,
            ),
        ),
    )
)
def test_the_parser_only_ever_raises_ingest_errors(value: Any) -> None:
    body = json.dumps(value).encode()
    try:
        parsed = parse_native(body, max_batch=10)
    except IngestError as exc:
        assert exc.status_code in (400, 413, 422)
    else:
        for _, stored in parsed.traces:
            assert json.loads(stored.body_json)["schema"] == "ratchet.trace/v1"


def nested(levels: int, kind: type = dict) -> Any:
    """A value with ``levels`` levels of objects (or arrays) around a string."""
    value: Any = "leaf"
    for _ in range(levels):
        value = {"k": value} if kind is dict else [value]
    return value


@pytest.mark.parametrize("kind", [dict, list])
def test_free_objects_may_nest_exactly_to_the_limit(kind: type) -> None:
    assert not depth_exceeded(nested(MAX_FREE_DEPTH, kind))
    assert depth_exceeded(nested(MAX_FREE_DEPTH + 1, kind))
    assert depth_exceeded({"wide": [1, {}, {"x": nested(MAX_FREE_DEPTH - 2, kind)}]})
    assert not depth_exceeded({"wide": [1, {}, {"x": nested(MAX_FREE_DEPTH - 3, kind)}]})
    assert not depth_exceeded("leaf") and not depth_exceeded({}) and depth_exceeded([], 0)
    validate_trace(make_trace(metadata=nested(MAX_FREE_DEPTH)))
    with pytest.raises(IngestError) as refused:
        validate_trace(make_trace(metadata=nested(MAX_FREE_DEPTH + 1)))
    assert refused.value.fields[0]["path"] == "metadata"
