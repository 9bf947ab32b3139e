"""The model server's door: what every request passes before a route, a parser or a model sees it.

Plain ASGI (no per-request task), in this order:

1. **Who may ask.** Two keys, two powers. With an API key (``RATCHET_SERVE_API_KEY``,
   vLLM's ``--api-key``) every route but ``/health`` and ``/healthz`` needs ``Authorization:
   Bearer <key>`` (401 otherwise); the admin key (``RATCHET_SERVE_ADMIN_KEY``) is accepted
   wherever the API key is. Without an API key on a loopback-only bind, loopback is not
   taken as an identity by itself: a request whose ``Host`` names another host (a web
   page's DNS rebinding) or that carries ``Forwarded``/``X-Forwarded-For`` (it came through
   a proxy on this machine) is refused (403) unless it carries the admin key. Whether the
   adapter routes may be used is the routes' own check (:func:`adapter_access_refusal`):
   only the admin key loads or unloads models, so the key agents hold serves and never
   swaps.
2. **How much.** A body over the limit is refused (413) from ``Content-Length`` at once, and
   while it streams in when chunked, so no client makes the server buffer more than the limit
   (one 131 MB request used to add 1.5 GB and stall ``/health``).

Every refusal is OpenAI's error object, so the ``openai`` client raises its usual errors.
Every answer is counted by status class in ``ratchet_serving_requests_total``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.body_limit import run_within_limit
from services.metrics import SERVING_REQUESTS
from services.modelserver.openai_api import OpenAIError

OPEN_PATHS = frozenset({"/health", "/healthz"})
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip")
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback only."""
    host = host.strip().strip("[]").lower().rstrip(".")
    if host in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host part of a ``Host`` header (``[::1]:8100`` -> ``::1``, ``a:80`` -> ``a``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, sep, port = header.rpartition(":")
    return name if sep and port.isdigit() else header


@dataclass(frozen=True)
class DoorPolicy:
    """What the door checks: the API key that serves and the admin key that also loads and
    unloads models (None: no such key), the bind address, the body limit."""

    api_key: str | None
    bind_host: str
    max_body_bytes: int
    admin_key: str | None = None

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the request carries the admin key."""
        return self.admin_key is not None and bearer_matches(authorization, self.admin_key)

    def is_inference(self, authorization: str | None) -> bool:
        """Whether the request carries the API key (the one that serves only)."""
        return self.api_key is not None and bearer_matches(authorization, self.api_key)

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.bind_host)

    def allows_host(self, header: str | None) -> bool:
        """A ``Host`` naming this machine's loopback or the bind address (absent is fine:
        browsers always send one, so a request without it is not a rebinding)."""
        if header is None:
            return True
        host = host_of(header)
        return is_loopback(host) or host == host_of(self.bind_host)


def bearer_matches(authorization: str | None, key: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


ADMIN_KEY_REQUIRED = "admin_key_required"


def adapter_access_refusal(
    policy: DoorPolicy, peer: str | None, authorization: str | None = None
) -> OpenAIError | None:
    """Why this request may not load or unload models (None: it may).

    With an admin key only that key may: the API key serves and never swaps (403), no key at
    all is 401. A server with an API key and no admin key lets no one swap its models: the
    key it hands out must not be the key that loads. With no key at all only a
    loopback-only server answers, and only to loopback peers (the door has refused foreign
    ``Host`` and forwarded requests): on any other bind anyone who can reach the port could
    swap the model."""
    if policy.admin_key is not None:
        if policy.is_admin(authorization):
            return None
        if policy.is_inference(authorization):
            return _admin_key_required("the API key serves completions only")
        return OpenAIError(
            401,
            "loading and unloading models needs the admin key "
            "(Authorization: Bearer <RATCHET_SERVE_ADMIN_KEY>)",
            kind="authentication_error",
            code="invalid_api_key",
        )
    if policy.api_key is not None:
        return _admin_key_required("this server has no admin key; its API key serves only")
    if not policy.loopback_only:
        return _admin_key_required("this server listens beyond loopback without an admin key")
    if peer is None or not (is_loopback(peer) or peer == "testclient"):
        return OpenAIError(
            403, "only this machine may load models on this server", kind="permission_error"
        )
    return None


def _admin_key_required(why: str) -> OpenAIError:
    return OpenAIError(
        403,
        f"{why}: loading and unloading models needs RATCHET_SERVE_ADMIN_KEY on the model "
        "server and that key in the request",
        kind="permission_error",
        code=ADMIN_KEY_REQUIRED,
    )


class ServingDoor:
    """Authenticate, check ``Host``/forwarding, and cap the body of every request."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope["path"], Headers(scope=scope))
            if refusal is not None:
                await send_error(counted, refusal)
            else:
                await self._within_limit(scope, receive, counted)
        finally:
            SERVING_REQUESTS.labels(f"{status // 100}xx").inc()

    def _refusal(self, path: str, headers: Headers) -> OpenAIError | None:
        policy = self.policy
        authorization = headers.get("authorization")
        if path not in OPEN_PATHS and not policy.is_admin(authorization):
            if policy.api_key is not None:
                if not policy.is_inference(authorization):
                    return OpenAIError(
                        401,
                        "missing or wrong API key (Authorization: Bearer <RATCHET_SERVE_API_KEY>)",
                        kind="authentication_error",
                        code="invalid_api_key",
                    )
            elif policy.loopback_only:
                if not policy.allows_host(headers.get("host")):
                    return OpenAIError(
                        403,
                        "the Host header names another host; this server answers only "
                        "requests addressed to this machine (set RATCHET_SERVE_API_KEY to "
                        "serve other names)",
                        kind="permission_error",
                        code="foreign_host",
                    )
                forwarded = next((h for h in FORWARDING_HEADERS if h in headers), None)
                if forwarded is not None:
                    return OpenAIError(
                        403,
                        f"a forwarded request ({forwarded}) is not from this machine; set "
                        "RATCHET_SERVE_API_KEY to serve through a proxy",
                        kind="permission_error",
                        code="forwarded_request",
                    )
        declared = headers.get("content-length")
        if declared is not None and not declared.strip().isdigit():
            return OpenAIError(400, "Content-Length is not a number", code="invalid_header")
        if declared is not None and int(declared) > policy.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"the request body is over the limit of {self.policy.max_body_bytes} bytes",
            code="body_too_large",
        )

    async def _within_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, answering 413 the moment a streamed body passes the limit
        (:func:`services.body_limit.run_within_limit`)."""

        async def refuse(send: Send) -> None:
            await send_error(send, self._too_large())

        await run_within_limit(
            self.app, scope, receive, send, limit=self.policy.max_body_bytes, refuse=refuse
        )


async def send_error(send: Send, error: OpenAIError) -> None:
    """``error`` as a complete HTTP answer (ASCII JSON: a lone surrogate in a message cannot
    break the encoding)."""
    body = json.dumps(error.body(), ensure_ascii=True).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
