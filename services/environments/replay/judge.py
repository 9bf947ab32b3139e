"""An LLM judge through any OpenAI-compatible chat-completions endpoint (vLLM, a hosted API,
``ratchet serve``), for tasks no reference answer or feedback can score.

The judge is asked, under the loop's rubric, whether an answer to the task's conversation is
acceptable, and told to reply ``PASS`` or ``FAIL`` (or a score between 0 and 1). Its reply is
read leniently: the first ``PASS``/``FAIL`` word or the first number in [0, 1]; a reply with
neither is a failing verdict marked ``unparseable`` (a judge that cannot say is no reason to
reward). Greedy decoding (``temperature`` 0) so the same question gets the same verdict.

Three things a judge in a training loop needs beyond one HTTP call:

- a **rate limit** (``requests_per_minute``): GRPO asks for a verdict per sample, and a
  hosted judge throttles;
- a **verdict cache** keyed by task id, answer, rubric and judge model: the same answer to
  the same task (a GRPO group often repeats one) is judged once per process;
- **usage**: calls, cache hits, prompt and completion tokens, seconds and the cost at the
  loop's price per 1k tokens, reported in the eval job's metrics (``judge``).

An endpoint that does not answer (refused, timed out, HTTP error, a body without a message)
raises :class:`JudgeError`: scoring a candidate 0 because its judge was down would be a
verdict nobody gave.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from services.chat.http import urlopen

_VERDICT_WORD = re.compile(r"\b(PASS|FAIL)\b", re.IGNORECASE)
_SCORE = re.compile(r"(?<![\d.])(0(?:\.\d+)?|1(?:\.0+)?)(?![\d.])")
JUDGE_SYSTEM = (
    "You are a strict grader. Read the task's conversation and the final answer, apply the "
    "rubric, and reply with exactly one word: PASS if the answer is acceptable, FAIL if not."
)


class JudgeError(RuntimeError):
    """The judge endpoint gave no verdict (unreachable, timed out, HTTP error, bad body)."""


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where a judge answers: the deployment's ``settings.judge_endpoints[name]``, resolved
    by the process that runs the job (a loop names the endpoint, never a URL)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Verdict:
    score: float
    passed: bool
    reply: str
    parsed: bool
    cached: bool = False


@dataclass
class JudgeUsage:
    """What the judge cost so far in this process."""

    calls: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        out["cost_usd"] = round(self.cost_usd, 6)
        return out


def parse_verdict(reply: str) -> tuple[float, bool]:
    """(score, parsed) from a judge's reply (see the module docstring)."""
    word = _VERDICT_WORD.search(reply)
    if word is not None:
        return (1.0 if word.group(1).upper() == "PASS" else 0.0), True
    score = _SCORE.search(reply)
    if score is not None:
        return float(score.group(1)), True
    return 0.0, False


class Judge:
    """One judge endpoint and model, with its rate limit, cache and usage (thread-safe)."""

    def __init__(
        self,
        endpoint: JudgeEndpoint,
        *,
        requests_per_minute: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if requests_per_minute <= 0:
            raise ValueError("requests_per_minute must be > 0")
        self.endpoint = endpoint
        self.interval_s = 60.0 / requests_per_minute
        self.usage = JudgeUsage()
        self._cache: dict[str, Verdict] = {}
        self._lock = threading.Lock()
        self._next_at = 0.0
        self._clock, self._sleep = clock, sleep

    def verdict(
        self,
        *,
        task_id: str,
        conversation: str,
        answer: str | None,
        rubric: str,
        model: str,
        cost_per_1k_tokens: float = 0.0,
    ) -> Verdict:
        """The judge's verdict on ``answer``; the same question is asked once per process."""
        key = hashlib.sha256(
            json.dumps([task_id, answer, rubric, model], ensure_ascii=False).encode("utf-8")
        ).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self.usage.cache_hits += 1
                return Verdict(hit.score, hit.passed, hit.reply, hit.parsed, cached=True)
        if answer is None or not answer.strip():
            verdict = Verdict(0.0, False, "", parsed=True)  # nothing to judge
        else:
            reply, prompt_tokens, completion_tokens, seconds = self._ask(
                model, _judge_messages(conversation, answer, rubric)
            )
            score, parsed = parse_verdict(reply)
            verdict = Verdict(score, score >= 0.5, reply, parsed)
            with self._lock:
                self.usage.calls += 1
                self.usage.prompt_tokens += prompt_tokens
                self.usage.completion_tokens += completion_tokens
                self.usage.seconds += seconds
                tokens = prompt_tokens + completion_tokens
                self.usage.cost_usd += tokens / 1000.0 * cost_per_1k_tokens
        with self._lock:
            self._cache[key] = verdict
        return verdict

    def _wait_turn(self) -> None:
        with self._lock:
            now = self._clock()
            start = max(now, self._next_at)
            self._next_at = start + self.interval_s
        if start > now:
            self._sleep(start - now)

    def _ask(self, model: str, messages: list[dict[str, str]]) -> tuple[str, int, int, float]:
        self._wait_turn()
        body = json.dumps(
            {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": 16}
        ).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.endpoint.api_key:
            headers["Authorization"] = f"Bearer {self.endpoint.api_key}"
        request = urllib.request.Request(
            f"{self.endpoint.url.rstrip('/')}/chat/completions", body, headers, method="POST"
        )
        started = time.monotonic()
        try:
            with urlopen(request, timeout=self.endpoint.timeout_s) as response:  # no key leaves
                data = json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise JudgeError(f"judge at {self.endpoint.url} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise JudgeError(f"judge at {self.endpoint.url} is unreachable: {reason}") from None
        except ValueError:
            raise JudgeError(f"judge at {self.endpoint.url} sent a body that is not JSON") from None
        seconds = time.monotonic() - started
        try:
            reply = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"judge at {self.endpoint.url} sent no choices[0].message") from None
        usage = data.get("usage") if isinstance(data, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        return (
            str(reply),
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            seconds,
        )


def _judge_messages(conversation: str, answer: str, rubric: str) -> list[dict[str, str]]:
    user = f"Rubric:\n{rubric}\n\nConversation:\n{conversation}\n\nFinal answer:\n{answer}"
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
