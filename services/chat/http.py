"""Outbound HTTP of the jobs (the judge, tool endpoints, rollout backends): a key sent to an
endpoint never follows a redirect to another origin.

``urllib``'s default redirect handler copies every header but the body's onto the
redirected request, ``Authorization`` included, whatever host the ``Location`` names: an
endpoint that answers ``302 Location: https://elsewhere/`` (misconfigured, or taken over)
would receive the judge's or the rollout server's key in the clear of another host. So these
clients open URLs through :func:`urlopen`, whose redirect handler follows a redirect within
the endpoint's own origin (scheme, host and port: a trailing slash, a moved path) and refuses
one that leaves it, with a ``URLError`` that names both origins; the caller reports it as it
reports an unreachable endpoint, and the operator points the endpoint at its final URL.

Standard library only: GPU jobs import it.
"""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from http.client import HTTPResponse
from typing import IO, Any
from urllib.parse import urlsplit


def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of ``url``, the port made explicit for http and https."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port


def refuse_other_origins(req: urllib.request.Request, newurl: str) -> None:
    """URLError when a redirect from ``req`` to ``newurl`` leaves the request's origin."""
    here, there = origin(req.full_url), origin(newurl)
    if here != there:
        raise urllib.error.URLError(
            f"redirected from {here[0]}://{here[1]}:{here[2]} to another origin "
            f"({there[0]}://{there[1]}:{there[2]}), which is refused: the request carries "
            "the endpoint's key; configure the endpoint's final URL"
        )


@functools.cache
def _opener() -> urllib.request.OpenerDirector:
    """The opener, with a redirect handler that follows only within the origin. Built on
    first use: workflow sandboxes import this module and may not subclass urllib's
    handlers at import time."""

    class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(
            self,
            req: urllib.request.Request,
            fp: IO[bytes],
            code: int,
            msg: str,
            headers: Any,
            newurl: str,
        ) -> urllib.request.Request | None:
            refuse_other_origins(req, newurl)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return urllib.request.build_opener(SameOriginRedirects)


def urlopen(request: urllib.request.Request, *, timeout: float) -> HTTPResponse:
    """``urllib.request.urlopen`` with :class:`SameOriginRedirects` (raises what it raises)."""
    response: HTTPResponse = _opener().open(request, timeout=timeout)
    return response
