"""Proof of delivery: after a deploy or rollback, the server must answer as the checkpoint did.

A deploy is verified by the server's word (``/v1/models`` lists the checkpoint's directory
and, on ``ratchet serve``, its id). That word can be true while the weights are not: an
adapter that never reached the sampler, a merge that went wrong, another replica still
serving the old weights. So the worker also sends the checkpoint's probe set
(:mod:`services.evaluation.probes`: a few greedy prompts with the token ids and log-probs
the checkpoint produced when it was evaluated) to the loop's model name and compares:

- the **token ids** must be equal (greedy decoding of the same weights on the same prompt
  gives the same tokens); a server that returns them (``return_token_ids``: ``ratchet
  serve``, vLLM) is compared on ids, and on the prompt ids it rendered too. One exception:
  a **near tie**. Where the evaluation's greedy choice led its runner-up by less than
  :data:`NEAR_TIE_NATS`, a server in bf16 may rightly pick the runner-up (each log-prob may
  move by the tolerance below, so their order may flip), and the answers part from there
  on. A server that picks exactly the evaluation's runner-up there, with its log-prob
  within tolerance, passes up to that token, and the note says where the tie was. A probe
  set without margins (written before them) is held to equal ids throughout;
- each **log-prob** must be within :data:`LOGPROB_ATOL` nats of the recorded one. Not equal:
  the evaluation ran in fp32 where a GPU server runs bf16 (8 bits of mantissa: logits of
  size 10 to 20 carry errors of a few hundredths) and batches rows with other requests
  (other kernels, other summation orders); 0.1 nats is several times that and far below
  what other weights give (a different checkpoint moves log-probs by whole nats, and
  almost always changes a greedy token within a few);
- a server that returns neither (a plain OpenAI-compatible one) is compared on the
  completion's text, and the note says the proof was on text only.

A probe that does not match is asked once more after :data:`RETRY_AFTER_S` (a replica
that has not finished loading the weights, a server restarting behind its service); a
second mismatch raises :class:`~services.serving.base.DeployFailed` naming the probe, the
token, what was expected and what came back. A checkpoint whose evaluation recorded no
probe set (runs from before probes) deploys with the note ``not verified: no probe set``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.evaluation.probes import Probe, ProbeSet
from services.serving.base import DeployFailed
from services.serving.client import ModelServerClient, RequestRefused

logger = logging.getLogger(__name__)

LOGPROB_ATOL = 0.1  # nats; why this much and no more: the module docstring
# A greedy choice that led by less than this may flip: two log-probs, each off by the
# tolerance in opposite directions, move their difference by twice it.
NEAR_TIE_NATS = 2 * LOGPROB_ATOL
RETRY_AFTER_S = 2.0
NO_PROBE_SET = "not verified: no probe set"

# What is asked of the server, most first: a server that refuses a field (400) is asked again
# without it, and the proof says what it rested on.
_ASKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("token ids and log-probs", {"logprobs": True, "return_token_ids": True}),
    ("log-probs and text", {"logprobs": True}),
    ("text only", {}),
)


@dataclass(frozen=True)
class DeliveryProof:
    """How a deploy's delivery was proven (or why it was not): ``note`` is what is shown."""

    verified: bool
    note: str
    checkpoint_id: str
    probes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verified": self.verified,
            "note": self.note,
            "checkpoint_id": self.checkpoint_id,
            "probes": self.probes,
        }


def not_verified(checkpoint_id: str, why: str = NO_PROBE_SET) -> DeliveryProof:
    return DeliveryProof(False, why, checkpoint_id)


@dataclass(frozen=True)
class Comparison:
    """How an answer compares with a probe: ``problem`` ("" when it matches) and, when the
    server took the evaluation's runner-up at a near tie, the token where it did."""

    problem: str = ""
    near_tie: int | None = None


def prove_delivery(
    client: ModelServerClient,
    model: str,
    probe_set: ProbeSet,
    *,
    checkpoint_id: str,
    retry_after_s: float = RETRY_AFTER_S,
    sleep: Callable[[float], None] = time.sleep,
) -> DeliveryProof:
    """Send every probe to ``model`` and compare, asking a probe that does not match once
    more after ``retry_after_s``; DeployFailed on the first probe that fails twice."""
    if probe_set.checkpoint_id != checkpoint_id:
        raise DeployFailed(
            f"the probe set is of checkpoint {probe_set.checkpoint_id[:12]}, not of "
            f"{checkpoint_id[:12]}"
        )
    basis = _ASKS[0][0]
    ties: list[str] = []
    retried = 0
    for index, probe in enumerate(probe_set.probes):
        answer, basis = _ask(client, model, probe, start=basis)
        compared = compare(probe, answer)
        if compared.problem:
            retried += 1
            sleep(retry_after_s)
            answer, basis = _ask(client, model, probe, start=basis)
            compared = compare(probe, answer)
        if compared.problem:
            raise DeployFailed(
                f"delivery not proven: {model!r} does not answer as {checkpoint_id[:12]} did "
                f"when evaluated: probe {index} (task {probe.task_id[:12]}): "
                f"{compared.problem} (asked twice)"
            )
        if compared.near_tie is not None:
            ties.append(f"probe {index} token {compared.near_tie}")
    note = _verified_note(len(probe_set.probes), basis, ties, retried)
    logger.info("%s serves %s: %s", model, checkpoint_id[:12], note)
    return DeliveryProof(True, note, checkpoint_id, len(probe_set.probes))


def _verified_note(probes: int, basis: str, ties: list[str], retried: int) -> str:
    note = f"verified: {probes} probes match on {basis}"
    if ties:
        note += (
            f"; the server took the evaluation's runner-up at a near tie (top-2 margin under "
            f"{NEAR_TIE_NATS:g} nats) at {', '.join(ties)}"
        )
    if retried:
        note += f"; {retried} matched when asked again"
    return note


def _ask(
    client: ModelServerClient, model: str, probe: Probe, *, start: str
) -> tuple[dict[str, Any], str]:
    """The server's answer to ``probe``, asking for as much as it takes (from ``start``)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": probe.messages,
        "max_tokens": probe.max_tokens,
        "temperature": 0,
    }
    if probe.tools:
        body["tools"] = probe.tools
        body["tool_choice"] = "none"  # the raw text, not parsed into tool calls
    names = [name for name, _ in _ASKS]
    for basis, extra in _ASKS[names.index(start) :]:
        try:
            return client.chat_completion({**body, **extra}), basis
        except RequestRefused as exc:
            if exc.status not in (400, 422) or basis == _ASKS[-1][0]:
                raise
        except ValueError:  # not JSON
            raise DeployFailed(f"{client.display_url} answered a probe with no JSON") from None
    raise AssertionError("unreachable")  # the last ask raises or returns


def mismatch(probe: Probe, answer: dict[str, Any]) -> str:
    """Why ``answer`` is not what the checkpoint answered to ``probe`` ("" if it is)."""
    return compare(probe, answer).problem


def compare(probe: Probe, answer: dict[str, Any]) -> Comparison:
    """``answer`` against ``probe`` (see the module): ids, then log-probs, else the text."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return Comparison("the answer has no choices")
    choice = choices[0]
    prompt_ids = answer.get("prompt_token_ids")
    if _int_list(prompt_ids) and prompt_ids != probe.prompt_token_ids:
        at = _first_difference(probe.prompt_token_ids, prompt_ids)
        return Comparison(f"the server rendered the prompt differently (prompt token {at})")
    got_ids = choice.get("token_ids")
    tie = None
    if isinstance(got_ids, list) and _int_list(got_ids):
        problem, tie = _compare_ids(probe, got_ids)
        if problem:
            return Comparison(problem)
    logprobs = _logprobs(choice)
    if logprobs is not None:
        problem = _compare_logprobs(probe, logprobs, tie)
        if problem:
            return Comparison(problem)
    if not _int_list(got_ids):
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if (text or "") != probe.text:
            at = _first_difference(probe.text, text or "")
            return Comparison(
                f"the completion's text differs from the candidate's at character {at}"
            )
    return Comparison("", tie)


def _compare_ids(probe: Probe, got: list[int]) -> tuple[str, int | None]:
    """Ids equal up to the end, or to a near tie where the server took the runner-up
    (its position returned); the server may or may not include the stop token."""
    expected = probe.token_ids + ([probe.stop_id] if probe.stop_id is not None else [])
    for at, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want == have:
            continue
        if _near_tie(probe, at) and probe.runners_up and have == probe.runners_up[at]:
            return "", at
        margin = f" (the evaluation led by {probe.margins[at]:.3f} nats)" if probe.margins else ""
        return f"token {at}: expected id {want}, got id {have}{margin}", None
    if len(got) > len(expected):
        return f"token {len(expected)}: expected the end, got id {got[len(expected)]}", None
    if len(got) < len(probe.token_ids):
        return f"token {len(got)}: expected id {expected[len(got)]}, got the end", None
    return "", None


def _near_tie(probe: Probe, at: int) -> bool:
    return (
        probe.margins is not None
        and at < len(probe.margins)
        and (probe.margins[at] < NEAR_TIE_NATS)
    )


def _compare_logprobs(probe: Probe, got: list[float], tie: int | None) -> str:
    """Each log-prob within the tolerance; after a near tie at ``tie`` the server's token
    there is the runner-up (whose log-prob is the sampled one's less the margin) and what
    follows it is another continuation, not compared."""
    expected = list(probe.logprobs)
    if tie is not None and probe.margins is not None:
        expected = [*expected[:tie], expected[tie] - probe.margins[tie]]
        got = got[: tie + 1]
    for at, (want, have) in enumerate(zip(expected, got, strict=False)):
        if abs(want - have) > LOGPROB_ATOL:
            return (
                f"token {at}: expected log-prob {want:.4f}, got {have:.4f} (more than "
                f"{LOGPROB_ATOL} apart)"
            )
    if tie is not None:
        return "" if len(got) == tie + 1 else f"{len(got)} log-probs came back, expected more"
    if len(got) < len(probe.token_ids) or len(got) > len(expected):
        return f"{len(got)} log-probs came back, expected {len(probe.token_ids)}"
    return ""


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    """OpenAI's ``choices[0].logprobs.content[*].logprob``, or None when not returned."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values if v is not None]


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def _first_difference(a: Any, b: Any) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
