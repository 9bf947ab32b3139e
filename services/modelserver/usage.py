"""What a model server spent per served version: tokens and busy compute-seconds.

Counting (``ratchet serve``): every answered request adds its tokens to
``ratchet_serving_prompt_tokens_total{version, source}`` (``cached``: keys and values reused
from the prefix cache; ``computed``: prefilled) and
``ratchet_serving_tokens_total{version, kind}``; the decode thread adds the wall time of
every prefill and forward step to ``ratchet_serving_busy_seconds_total{version}``.

How a batch's time is shared when rows of several versions (a base model and its adapters)
run in it: a prefill of joining rows is split in proportion to each row's prompt tokens
(each pays for the prompt it brought, whoever's cache it reused), and a decode step is split
equally among the rows running in it (every row gets one token from it, and a step's cost
is the weights read once for all of them). So the shares of a version never depend on what
else happened to be in the batch beyond its own rows' count, and they sum to the engine's
busy time.

Reading (:func:`parse_usage`): the same text format from ``ratchet serve`` (per version) or
a vLLM server (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:prefix_cache_hits_total``: its own names, summed over its ``model_name`` label, as
vLLM labels by the base model and not by adapter). vLLM exports no busy time, so its usage
has ``busy_seconds=None`` and the ledger counts the wall time the version was served (a
dedicated replica is paid for by the hour, busy or not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import SERVING_BUSY_SECONDS, SERVING_PROMPT_TOKENS, SERVING_TOKENS

WHOLE_SERVER = "*"  # the key of a server whose counters are not per version (vLLM)

_RATCHET_PROMPT = "ratchet_serving_prompt_tokens"
_RATCHET_TOKENS = "ratchet_serving_tokens"
_RATCHET_BUSY = "ratchet_serving_busy_seconds"
_VLLM_PROMPT = "vllm:prompt_tokens"
_VLLM_GENERATION = "vllm:generation_tokens"
_VLLM_CACHE_HITS = "vllm:prefix_cache_hits"


class UsageUnavailable(Exception):
    """The server's /metrics did not answer, or answered with no usage counters."""


@dataclass(frozen=True)
class VersionUsage:
    """A version's cumulative counters on one server process (they reset when it restarts).

    ``prompt_tokens`` includes ``cached_prompt_tokens``; ``busy_seconds`` is None where the
    server does not measure it (vLLM)."""

    prompt_tokens: float = 0.0
    cached_prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    busy_seconds: float | None = 0.0

    @property
    def tokens(self) -> float:
        return self.prompt_tokens + self.completion_tokens


# Counting ---------------------------------------------------------------------------------


class FinishedRow(Protocol):
    """What counting reads of a finished row (the engine's ``GenerationResult``; named by
    its shape so the api, which reads usage, never imports the engine and torch)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...


def count_completion(version: str, prompt_tokens: int, results: Sequence[FinishedRow]) -> None:
    """Add one answered request's tokens to the version's counters: the prompt once per
    request in ``ratchet_serving_tokens_total``, and every row's prompt by source (a request
    with ``n`` choices prefills ``n`` rows) in ``ratchet_serving_prompt_tokens_total``."""
    SERVING_TOKENS.labels(version, "prompt").inc(prompt_tokens)
    SERVING_TOKENS.labels(version, "completion").inc(sum(len(r.token_ids) for r in results))
    for result in results:
        SERVING_PROMPT_TOKENS.labels(version, "cached").inc(result.cached_tokens)
        SERVING_PROMPT_TOKENS.labels(version, "computed").inc(
            result.prompt_tokens - result.cached_tokens
        )


def busy_shares(seconds: float, weights: Sequence[tuple[str, float]]) -> dict[str, float]:
    """``seconds`` of engine time split over rows in proportion to their weights, summed per
    version (rows given as ``(version, weight)``); equal shares when every weight is 0."""
    if not weights or seconds <= 0:
        return {}
    total = sum(weight for _, weight in weights)
    shares: dict[str, float] = {}
    for version, weight in weights:
        part = weight / total if total > 0 else 1.0 / len(weights)
        shares[version] = shares.get(version, 0.0) + seconds * part
    return shares


def count_busy(seconds: float, weights: Sequence[tuple[str, float]]) -> None:
    """Add a prefill's or a step's wall time to the versions of its rows (see the module
    docstring for the weights); rows of no version ("") take their share uncounted."""
    for version, share in busy_shares(seconds, weights).items():
        if version:
            SERVING_BUSY_SECONDS.labels(version).inc(share)


# Reading ----------------------------------------------------------------------------------


def parse_usage(text: str) -> dict[str, VersionUsage]:
    """Per-version usage from a /metrics page of ``ratchet serve``, or the whole server's
    (under :data:`WHOLE_SERVER`) from a vLLM one; empty when neither's counters are there."""
    sums: dict[tuple[str, str], float] = {}
    vllm = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created samples and the like
            name = sample.name[: -len("_total")]
            if name == _RATCHET_PROMPT:
                key = (sample.labels.get("version", ""), sample.labels.get("source", ""))
            elif name == _RATCHET_TOKENS:
                key = (sample.labels.get("version", ""), sample.labels.get("kind", ""))
            elif name == _RATCHET_BUSY:
                key = (sample.labels.get("version", ""), "busy")
            elif name in (_VLLM_PROMPT, _VLLM_GENERATION, _VLLM_CACHE_HITS):
                vllm = True
                key = (WHOLE_SERVER, name)
            else:
                continue
            sums[key] = sums.get(key, 0.0) + sample.value
    if vllm:
        return {
            WHOLE_SERVER: VersionUsage(
                prompt_tokens=sums.get((WHOLE_SERVER, _VLLM_PROMPT), 0.0),
                cached_prompt_tokens=sums.get((WHOLE_SERVER, _VLLM_CACHE_HITS), 0.0),
                completion_tokens=sums.get((WHOLE_SERVER, _VLLM_GENERATION), 0.0),
                busy_seconds=None,
            )
        }
    versions = {version for version, _ in sums if version}
    return {
        version: VersionUsage(
            prompt_tokens=sums.get((version, "cached"), 0.0) + sums.get((version, "computed"), 0.0),
            cached_prompt_tokens=sums.get((version, "cached"), 0.0),
            completion_tokens=sums.get((version, "completion"), 0.0),
            busy_seconds=sums.get((version, "busy"), 0.0),
        )
        for version in sorted(versions)
    }


def usage_of(usage: Mapping[str, VersionUsage], version: str) -> VersionUsage:
    """The counters that belong to ``version``: its own, or the whole server's (vLLM), or
    zeros when the server has not served it yet."""
    if WHOLE_SERVER in usage:
        return usage[WHOLE_SERVER]
    return usage.get(version, VersionUsage())


def read_usage(
    url: str, *, api_key: str | None = None, timeout_s: float = 10.0
) -> dict[str, VersionUsage]:
    """GET ``url``/metrics and parse it; :class:`UsageUnavailable` when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return parse_usage(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        raise UsageUnavailable(f"reading {url}/metrics failed: {exc}") from exc
