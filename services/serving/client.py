"""Admin calls to an OpenAI-compatible model server: what the serving targets use.

Works against vLLM and SGLang (runtime LoRA updating enabled) and ``ratchet serve``: the
adapter endpoints are vLLM's, ``/v1/models`` is OpenAI's with vLLM's ``root`` (the
directory a name was loaded from) and ``parent`` fields, and the probe is an ordinary chat
completion. Agents do not use this: they use the ``openai`` client.

What a server answers never reaches an error message beyond its status code: errors land in
Temporal histories, logs and the dashboard, and a server (or whoever answers at its address)
could put anything in a body, a credential it was sent included. Each status gets a fixed
description instead (:data:`STATUS_DESCRIPTIONS`); short fields read from a model list are
quoted and cut (:func:`quoted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from services.modelserver.openai_api import VERSION_HEADER
from services.serving.base import DeployFailed, ServingUnavailable

PROBE_MESSAGES = [{"role": "user", "content": "ping"}]
SHOWN_CHARS = 80  # of a field a server reported, in an error message

# What a refusal means for a deploy, by status code: the only words of an error that are not
# Ratchet's own are the status code itself.
STATUS_DESCRIPTIONS = {
    400: "the request was refused as invalid (a checkpoint the server cannot load?)",
    401: "the server wants an API key, or refused the one sent: check the serving "
    "endpoint's api_key (or RATCHET_SERVE_ADMIN_KEY for the local model server)",
    403: "the server refused this client: check the serving endpoint's api_key (a `ratchet "
    "serve` loads models only for its admin key, RATCHET_SERVE_ADMIN_KEY)",
    404: "the route or model is not there (for adapters, vLLM needs "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)",
    405: "the server does not take this method on this route",
    409: "the server refused it as a conflict (a name already loaded?)",
    413: "the request was too large for the server",
    422: "the server could not process the request",
}


class RequestRefused(DeployFailed):
    """The server refused a request with a 4xx status (``status``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelCard:
    """One entry of ``GET /v1/models``."""

    id: str
    root: str | None
    parent: str | None
    version: str | None  # ``ratchet serve`` reports the checkpoint id; vLLM does not


@dataclass(frozen=True)
class ProbeAnswer:
    """Who answered a one-token completion: the name echoed and the version it reported."""

    model: str
    version: str | None


class ModelServerClient:
    """Typed calls to one model server. Safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        load_timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.display_url = _without_userinfo(self.base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        self._load_timeout_s = load_timeout_s

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ModelServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> dict[str, ModelCard]:
        data = self._request("GET", "/v1/models").json()
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ServingUnavailable(f"{self.display_url}/v1/models did not answer a model list")
        cards = {}
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            extra = entry.get("ratchet")
            extra = extra if isinstance(extra, dict) else {}
            cards[entry["id"]] = ModelCard(
                id=entry["id"],
                root=_str_or_none(entry.get("root")),
                parent=_str_or_none(entry.get("parent")),
                version=_str_or_none(extra.get("version")),
            )
        return cards

    def load(self, name: str, path: str, *, inplace: bool = False) -> None:
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if inplace:
            body["load_inplace"] = True
        self._request("POST", "/v1/load_lora_adapter", json=body, timeout=self._load_timeout_s)

    def unload(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def probe(self, model: str) -> ProbeAnswer:
        """A one-token greedy completion from ``model``: proof that the name answers."""
        body = {"model": model, "messages": PROBE_MESSAGES, "max_tokens": 1, "temperature": 0}
        response = self._request("POST", "/v1/chat/completions", json=body)
        data = response.json()
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            raise DeployFailed(f"the probe of {model!r} got no completion back")
        version = response.headers.get(VERSION_HEADER)
        fingerprint = data.get("system_fingerprint")
        if version is None and isinstance(fingerprint, str) and fingerprint.startswith("ratchet-"):
            version = fingerprint.removeprefix("ratchet-")
        return ProbeAnswer(model=data["model"], version=version)

    def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion (the proof of delivery's probes); the response object."""
        data = self._request("POST", "/v1/chat/completions", json=body).json()
        if not isinstance(data, dict):
            raise DeployFailed(f"{self.display_url} answered a chat completion with no object")
        return data

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        where = f"model server {self.display_url}"
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(
                f"{where} did not answer {method} {path} ({type(exc).__name__})"
            ) from None
        status = response.status_code
        if status >= 500 or status in (408, 429):
            raise ServingUnavailable(f"{where} failed {method} {path} with status {status}")
        if status >= 400:
            description = STATUS_DESCRIPTIONS.get(status, "the server refused the request")
            raise RequestRefused(
                f"{where} refused {method} {path} ({status}): {description}", status
            )
        return response


def quoted(value: str | None) -> str:
    """A value a server reported, as an error shows it: quoted, and cut to a few words."""
    if value is None:
        return "None"
    shown = value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS] + "..."
    return repr(shown)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _without_userinfo(url: str) -> str:
    """``url`` without ``user:password@``: what error messages may show of it."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))
