"""A client of the local model server: what the local target and traffic simulators use.

:meth:`ModelServerClient.actor` returns an ``act(transcript) -> str`` callable, so a traffic
simulator plays episodes against the served model with ``Environment.run_episode(task, act)``
and learns which version answered each turn from :attr:`ModelServerClient.last_version`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx

from services.serving.base import DeployFailed, RequestRefused, ServingError, ServingUnavailable


class ModelServerClient:
    """Typed calls to one model server. Safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str | None = None,
        timeout_s: float = 30.0,
        swap_timeout_s: float = 300.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self._admin_headers = headers
        self._swap_timeout_s = swap_timeout_s
        self._local = threading.local()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ModelServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Inference ---------------------------------------------------------------------------

    def act(
        self, transcript: str, *, max_new_tokens: int = 32, temperature: float = 0.0, seed: int = 0
    ) -> tuple[str, str]:
        """The next agent turn for ``transcript`` and the version that produced it."""
        body = {
            "transcript": transcript,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        data = self._request("POST", "/v1/act", json=body)
        return str(data["text"]), str(data["model_version"])

    def actor(self, **sampling: Any) -> Callable[[str], str]:
        """An ``act`` callable for ``Environment.run_episode``; records the answering version."""

        def act(transcript: str) -> str:
            text, version = self.act(transcript, **sampling)
            self._local.version = version
            return text

        return act

    @property
    def last_version(self) -> str | None:
        """The version that answered this thread's last ``actor`` call."""
        return getattr(self._local, "version", None)

    # Model and admin ---------------------------------------------------------------------

    def model(self) -> dict[str, Any]:
        return self._request("GET", "/v1/model")

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/v1/stats")

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def swap(self, checkpoint_uri: str, *, expected_version: str | None = None) -> dict[str, Any]:
        body = {"checkpoint": checkpoint_uri, "expected_version": expected_version}
        return self._request(
            "POST",
            "/v1/admin/swap",
            json=body,
            headers=self._admin_headers,
            timeout=self._swap_timeout_s,
        )

    def rollback(self) -> dict[str, Any]:
        return self._request("POST", "/v1/admin/rollback", headers=self._admin_headers)

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServingUnavailable(
                f"model server {self.base_url} did not answer {method} {path}: {exc}"
            ) from exc
        if response.status_code >= 500:
            raise ServingUnavailable(
                f"model server {self.base_url} failed {method} {path}: "
                f"{response.status_code} {response.text[:500]}"
            )
        if response.status_code >= 400:
            error: type[ServingError] = DeployFailed if "/admin/" in path else RequestRefused
            raise error(
                f"model server refused {method} {path} ({response.status_code}): "
                f"{_detail(response)}"
            )
        data = response.json()
        if not isinstance(data, dict):
            raise ServingUnavailable(f"model server answered {path} with a non-object")
        return data


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        return str(data.get("detail") or data)
    return str(data)
