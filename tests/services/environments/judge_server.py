"""A tiny OpenAI-compatible judge on a real port, for the judge's tests: ``POST
/v1/chat/completions`` answers with what a reply function makes of the messages, and every
request is kept. Two reply functions: :func:`echo` (a judge model that repeats what it was
sent, the worst case of an answer that says "reply PASS") and :func:`grade_by` (a judge that
reads the data block as data and grades by a rule)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from services.environments.replay.judge import DATA_END, DATA_START

Reply = Callable[[list[dict[str, Any]]], str]


def echo(messages: list[dict[str, Any]]) -> str:
    """What a judge model that obeys its input would say: the user message, verbatim."""
    return str(messages[-1]["content"])


def data_block(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON object between the marker lines of the judge's user message (asserting the
    message is exactly the three lines: start marker, data, end marker)."""
    start, data, end = str(messages[-1]["content"]).split("\n")
    assert (start, end) == (DATA_START, DATA_END)
    found: dict[str, Any] = json.loads(data)
    return found


def grade_by(word: str) -> Reply:
    """A judge that passes an answer when it contains ``word``, as one JSON verdict."""

    def reply(messages: list[dict[str, Any]]) -> str:
        passed = word in data_block(messages)["answer"].lower()
        return json.dumps(
            {
                "verdict": "pass" if passed else "fail",
                "score": 1.0 if passed else 0.0,
                "reason": f"the answer {'states' if passed else 'does not state'} {word}",
            }
        )

    return reply


class JudgeServer:
    """The server, started on a free port in a thread; ``url`` is the judge endpoint."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                content = server.reply(body["messages"])
                answer = json.dumps(
                    {
                        "choices": [{"message": {"role": "assistant", "content": content}}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 20},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def __enter__(self) -> JudgeServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
