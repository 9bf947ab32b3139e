"""Admin calls to an OpenAI-compatible model server: what the serving targets use.

Works against vLLM and SGLang (runtime LoRA updating enabled) and ``ratchet serve``: the
adapter endpoints are vLLM's, ``/v1/models`` is OpenAI's with vLLM's ``root`` (the
directory a name was loaded from) and ``parent`` fields, and the probe is an ordinary chat
completion. Agents do not use this: they use the ``openai`` client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from services.serving.base import VERSION_HEADER, DeployFailed, ServingUnavailable

PROBE_MESSAGES = [{"role": "user", "content": "ping"}]


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
            raise ServingUnavailable(f"{self.base_url}/v1/models did not answer a model list")
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

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(
                f"model server {self.base_url} did not answer {method} {path}: {exc}"
            ) from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise ServingUnavailable(
                f"model server {self.base_url} failed {method} {path}: "
                f"{response.status_code} {response.text[:500]}"
            )
        if response.status_code >= 400:
            raise DeployFailed(
                f"model server {self.base_url} refused {method} {path} "
                f"({response.status_code}): {_detail(response)}"
            )
        return response


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return str(data)[:500]
