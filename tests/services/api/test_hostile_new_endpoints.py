"""A hostile-input pass of the endpoints issue 43 asked about: feedback, the trace listing,
and the judge and tool configuration of a loop (its ``curation_policy``).

test_openapi_fuzz.py sends every operation generated requests, but unsigned feedback stops
at 401 and a random loop name at 404. Here the requests reach the code behind: feedback
signed with the loop's real secret on a trace that exists (and on a purged one), listings
of a loop that has traces, configuration changes of a loop that exists. Bounded, seeded
(hypothesis, derandomized) plus hand-made bodies written to hurt. The contract: never a
5xx; answers bounded (a listing page holds at most ``limit`` <= 500 rows); and nothing
accepted lost (every 201 feedback is a row, every accepted change reads back).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from services.db.models import Trace, TraceFeedback
from services.db.queries.retention import retire_trace_bodies
from services.db.session import SessionFactory
from tests.services.api.support import ADMIN, body_of, create_loop, make_trace, signed_headers

BOUNDED = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
FEEDBACK_OK = {200, 201, 400, 404, 409, 410, 413, 415, 422}

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=300),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=12,
)


def post_signed(client: TestClient, loop: dict[str, Any], path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers=signed_headers(loop["signing_secret"], body))


def seed_traces(client: TestClient, loop: dict[str, Any], ids: list[str]) -> None:
    body = body_of({"traces": [make_trace(i) for i in ids]})
    response = post_signed(client, loop, f"/v1/loops/{loop['name']}/traces", body)
    assert response.status_code == 200, response.text


def feedback_count(session_factory: SessionFactory) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(TraceFeedback)) or 0)


# Feedback -------------------------------------------------------------------------------------

FEEDBACK_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(max_size=300), JSON_LEAF),
        "score": st.one_of(st.floats(allow_nan=False, allow_infinity=False), JSON_LEAF),
        "label": st.one_of(st.text(max_size=250), JSON_LEAF),
        "correction": st.one_of(st.text(max_size=500), JSON_VALUE),
        "comment": st.one_of(st.text(max_size=500), JSON_LEAF),
        "stray": JSON_VALUE,
    },
)


def test_signed_feedback_of_any_shape_is_never_a_5xx_and_every_201_is_kept(
    client: TestClient, session_factory: SessionFactory
) -> None:
    loop = create_loop(client, "hostile-feedback")
    seed_traces(client, loop, ["t-1", "t/2", "t-old"])
    _purge(session_factory, "t-old")  # feedback on it is a 410
    created = 0
    seen: set[int] = set()

    @BOUNDED
    @given(
        fields=FEEDBACK_FIELDS,
        trace=st.sampled_from(["t-1", "t/2", "t-old", "nope"]),
        named=st.sampled_from(["same", "other", "absent"]),
    )
    def fuzz(fields: dict[str, Any], trace: str, named: str) -> None:
        nonlocal created
        document = dict(fields)
        if named == "same":
            document["external_id"] = trace
        elif named == "other":
            document["external_id"] = "t-1" if trace != "t-1" else "t/2"
        path = f"/v1/loops/{loop['name']}/traces/{trace}/feedback"
        response = post_signed(client, loop, path, json.dumps(document).encode())
        assert response.status_code in FEEDBACK_OK, (document, response.text)
        if response.status_code == 201:
            created += 1
            seen.add(response.json()["id"])

    fuzz()
    for name, body in hostile_feedback_bodies():
        path = f"/v1/loops/{loop['name']}/traces/t-1/feedback"
        response = post_signed(client, loop, path, body)
        assert response.status_code in FEEDBACK_OK - {200, 201}, (name, response.text)
    assert created == len(seen) == feedback_count(session_factory)  # nothing accepted lost


def _purge(session_factory: SessionFactory, external_id: str) -> None:
    """Retention purges the body of ``external_id`` alone (it is made older than the rest)."""
    now = dt.datetime.now(dt.UTC)
    long_ago = now - dt.timedelta(days=400)  # a period with no partition: the default one
    with session_factory.begin() as session:
        session.execute(
            update(Trace).where(Trace.external_id == external_id).values(received_at=long_ago)
        )
        retired = retire_trace_bodies(
            session=session, received_before=long_ago + dt.timedelta(seconds=1), now=now
        )
        assert retired is not None and sum(r.rows for r in retired) == 1


def hostile_feedback_bodies() -> list[tuple[str, bytes]]:
    named = {"external_id": "t-1"}
    return [
        ("empty", b""),
        ("not json", b"{'score': 1}"),
        ("nan", b'{"external_id": "t-1", "score": NaN}'),
        ("huge exponent", b'{"external_id": "t-1", "score": 1e999999}'),
        ("lone surrogate", b'{"external_id": "t-1", "correction": "\\ud800"}'),
        ("nul", json.dumps({**named, "label": "a\u0000b"}).encode()),
        ("deep", b'{"external_id": "t-1", "correction": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        ("too big", json.dumps({**named, "comment": "x" * 2_000_000}).encode()),
        ("long correction", json.dumps({**named, "correction": "x" * 100_001}).encode()),
        ("array", b"[1, 2, 3]"),
        ("says nothing", json.dumps(named).encode()),
        ("other trace", json.dumps({"external_id": "t/2", "score": 1}).encode()),
    ]


# The trace listing ----------------------------------------------------------------------------

QUERY_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["failure", "success", "unknown", "task", "rejected", "pending", "curation_failed"]
    ),
    st.sampled_from(["2026-12-01T00:00:00Z", "2026-12-01", "9999-99-99", "-1", "1e9", "\x00"]),
    st.text(min_size=1000, max_size=5000),
)


def test_the_trace_listing_takes_any_query_without_a_5xx_and_stays_bounded(
    client: TestClient,
) -> None:
    loop = create_loop(client, "hostile-listing")
    seed_traces(client, loop, [f"l-{i}" for i in range(30)])
    cursor = client.get(f"/v1/loops/{loop['name']}/traces?limit=2", headers=ADMIN).json()[
        "next_cursor"
    ]

    @BOUNDED
    @given(
        params=st.dictionaries(
            st.sampled_from(["outcome", "curation", "reason", "since", "until", "limit", "cursor"]),
            st.one_of(QUERY_TEXT, st.integers(-(2**64), 2**64).map(str), st.just(cursor)),
            max_size=7,
        ),
        trace=st.one_of(st.sampled_from(["l-1", "..%2f..%2f", "%00", "a" * 3000]), st.text()),
    )
    def fuzz(params: dict[str, str], trace: str) -> None:
        listing = client.get(f"/v1/loops/{loop['name']}/traces", params=params, headers=ADMIN)
        assert listing.status_code in (200, 400, 422), (params, listing.text)
        if listing.status_code == 200:
            assert len(listing.json()["traces"]) <= 500
        one = client.get(f"/v1/loops/{loop['name']}/traces/{trace}", headers=ADMIN)
        assert one.status_code in (200, 400, 404, 422), (trace, one.text)

    fuzz()


def test_a_nul_anywhere_in_the_url_is_a_400_not_a_database_error(client: TestClient) -> None:
    """Postgres text cannot hold NUL: on main each of these reached a query and was a 500."""
    loop = create_loop(client, "nul-urls")
    for path in (
        "/v1/loops/%00",
        "/v1/loops/a%00b/traces",
        f"/v1/loops/{loop['name']}/traces/x%00y",
        f"/v1/loops/{loop['name']}/traces?reason=%00",
        "/loops/%00",
    ):
        response = client.get(path, headers=ADMIN)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_url"


# Judge and tool configuration ----------------------------------------------------------------

POLICY_KEYS = [
    "judge_endpoint",
    "judge_model",
    "judge_rubric",
    "judge_cost_per_1k_tokens",
    "tool_endpoint",
    "reference_match",
]
POLICY_VALUE = st.one_of(
    st.sampled_from(["grader", "unknown-endpoint", "", "x" * 5000]),
    JSON_VALUE,
)


def test_judge_and_tool_configuration_of_any_shape_is_refused_cleanly_or_kept(
    client: TestClient,
) -> None:
    loop = create_loop(client, "hostile-config")
    url = f"/v1/loops/{loop['name']}"

    @BOUNDED
    @given(policy=st.dictionaries(st.sampled_from(POLICY_KEYS), POLICY_VALUE, max_size=6))
    def fuzz(policy: dict[str, Any]) -> None:
        response = client.patch(url, json={"curation_policy": policy}, headers=ADMIN)
        assert response.status_code in (200, 422), (policy, response.text)
        if response.status_code == 200:  # accepted: what it said is what the loop has now
            stored = client.get(url, headers=ADMIN).json()["curation_policy"]
            for key, value in policy.items():
                if value is not None:
                    assert stored.get(key) == value, (key, stored.get(key), value)
        created = client.post(
            "/v1/loops",
            json={
                "name": "hostile-new",
                "environment": "toolcalc",
                "serving_target": {"kind": "none"},
                "curation_policy": policy,
            },
            headers=ADMIN,
        )
        assert created.status_code in (201, 409, 422), (policy, created.text)

    fuzz()
