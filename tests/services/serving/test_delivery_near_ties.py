"""Proof of delivery that does not refuse a correct deploy (issue 43, item 7).

An fp32 evaluation and a bf16 server may part where the evaluation's greedy choice led its
runner-up by a hair: on main that refused the deploy. Now the server may take exactly the
runner-up where the evaluation's top-2 margin was under NEAR_TIE_NATS (and is held to
equal ids everywhere else), and a probe that does not match is asked once more. A real
HTTP server stands in for the model server's answers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from services.evaluation.probes import Probe, ProbeFileError, ProbeSet, parse_probe_set
from services.serving.base import DeployFailed
from services.serving.client import ModelServerClient
from services.serving.delivery import LOGPROB_ATOL, NEAR_TIE_NATS, compare, prove_delivery

TIGHT = NEAR_TIE_NATS / 4  # a margin a bf16 server may flip
WIDE = NEAR_TIE_NATS * 10  # one it may not


def probe(margin_at_1: float | None = TIGHT) -> Probe:
    """Greedy ids 10, 11, 12 then stop 99; at token 1 the runner-up was 21."""
    return Probe(
        task_id="t" * 64,
        messages=[{"role": "user", "content": "hi"}],
        tools=[],
        max_tokens=8,
        prompt_token_ids=[1, 2, 3],
        token_ids=[10, 11, 12],
        stop_id=99,
        logprobs=[-0.5, -0.7, -0.2, -0.1],
        text="abc",
        margins=None if margin_at_1 is None else [2.0, margin_at_1, 3.0, 4.0],
        runners_up=None if margin_at_1 is None else [20, 21, 22, 23],
    )


def answer(token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    content = [{"token": "x", "logprob": value} for value in logprobs]
    return {
        "choices": [
            {
                "message": {"role": "assistant", "content": "?"},
                "token_ids": token_ids,
                "logprobs": {"content": content},
            }
        ]
    }


def test_the_runner_up_at_a_near_tie_is_accepted_up_to_that_token() -> None:
    runner_up_logprob = -0.7 - TIGHT
    compared = compare(probe(), answer([10, 21, 5, 6], [-0.5, runner_up_logprob, -1, -1]))
    assert (compared.problem, compared.near_tie) == ("", 1)


def test_a_wide_margin_or_another_token_is_still_refused() -> None:
    wide = compare(probe(WIDE), answer([10, 21, 5], [-0.5, -0.7 - WIDE, -1]))
    assert wide.problem == "token 1: expected id 11, got id 21 (the evaluation led by 2.000 nats)"
    other = compare(probe(), answer([10, 30, 5], [-0.5, -0.7, -1]))
    assert other.problem.startswith("token 1: expected id 11, got id 30")
    off = compare(probe(), answer([10, 21, 5], [-0.5, -0.7 - TIGHT - 2 * LOGPROB_ATOL, -1]))
    assert off.problem.startswith("token 1: expected log-prob")
    before = compare(probe(), answer([13, 11, 12], [-0.5, -0.7, -0.2]))
    assert before.problem.startswith("token 0: expected id 10, got id 13")  # margin 2.0 there


def test_a_probe_set_without_margins_is_held_to_equal_ids() -> None:
    old = compare(probe(None), answer([10, 21, 5], [-0.5, -0.7 - TIGHT, -1]))
    assert old.problem == "token 1: expected id 11, got id 21"


def test_margins_are_read_back_and_checked() -> None:
    def document(**fields: Any) -> dict[str, Any]:
        item = {
            "task_id": "t",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [],
            "max_tokens": 4,
            "prompt_token_ids": [1],
            "token_ids": [2],
            "stop_id": None,
            "logprobs": [-0.5],
            "text": "x",
            **fields,
        }
        return {"schema": "ratchet.probes/v1", "checkpoint_id": "ck", "probes": [item]}

    read = parse_probe_set(document(margins=[0.01], runners_up=[7]))
    assert (read.probes[0].margins, read.probes[0].runners_up) == ([0.01], [7])
    assert parse_probe_set(document()).probes[0].margins is None
    for bad in ({"margins": [-1.0], "runners_up": [7]}, {"margins": [0.1]}, {"runners_up": [7]}):
        with pytest.raises(ProbeFileError, match=r"margins|runners_up"):
            parse_probe_set(document(**bad))


class Canned:
    """A model server answering chat completions from a list, one answer per request."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.asked = 0
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps(canned.answers[min(canned.asked, len(canned.answers) - 1)])
                canned.asked += 1
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def serve() -> Iterator[type[Canned]]:
    made: list[Canned] = []

    class Serving(Canned):
        def __init__(self, answers: list[dict[str, Any]]) -> None:
            super().__init__(answers)
            made.append(self)

    yield Serving
    for server in made:
        server.server.shutdown()
        server.server.server_close()


EXACT = answer([10, 11, 12, 99], [-0.5, -0.7, -0.2, -0.1])
WRONG = answer([10, 30, 5, 99], [-0.5, -0.7, -0.2, -0.1])
TIE = answer([10, 21, 5, 6], [-0.5, -0.7 - TIGHT, -1, -1])


def prove(server: Canned, *probes: Probe) -> str:
    naps: list[float] = []
    with ModelServerClient(server.url) as client:
        proof = prove_delivery(
            client, "agent", ProbeSet("ck", list(probes)), checkpoint_id="ck", sleep=naps.append
        )
    assert proof.verified
    return proof.note


def test_a_near_tie_is_said_in_the_proof(serve: type[Canned]) -> None:
    note = prove(serve([TIE]), probe())
    assert note == (
        "verified: 1 probes match on token ids and log-probs; the server took the "
        "evaluation's runner-up at a near tie (top-2 margin under 0.2 nats) at probe 0 token 1"
    )


def test_a_probe_that_fails_once_is_asked_again(serve: type[Canned]) -> None:
    server = serve([WRONG, EXACT])
    note = prove(server, probe())
    assert note.endswith("; 1 matched when asked again") and server.asked == 2


def test_a_probe_that_fails_twice_fails_the_deploy(serve: type[Canned]) -> None:
    server = serve([WRONG, WRONG])
    with pytest.raises(DeployFailed, match=r"token 1: expected id 11, got id 30.*\(asked twice\)"):
        prove(server, probe())
    assert server.asked == 2
