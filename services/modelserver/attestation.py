"""Response ids the model server signs, so a trace's model version is the server's word.

The canary compares live success of the new champion with the old one by the traces'
``model_version``. An agent reports that version itself, so a buggy or hostile client could
credit the old model's failures to the new one (or the reverse) and decide a rollback. The
model server knows which checkpoint produced each completion; it says so in the
``X-Ratchet-Model-Version`` header, but a header does not travel with a trace. The response
id does: OpenTelemetry's GenAI instrumentations record it as ``gen_ai.response.id`` on every
chat span, and a ``ratchet.trace/v1`` trace carries it in ``response_ids``.

So a server with an attestation key (``RATCHET_SERVE_ATTESTATION_KEY``, which the worker
hands to the model servers it starts and which agents never hold) makes each id
``chatcmpl-<nonce><mac>``, the mac an HMAC-SHA256 of the nonce and the served version. The
worker checks a trace's ids against the version the trace claims: a trace whose every id
verifies was served by that version. An id carries no secret and costs one HMAC to check.
A replayed id proves only that the version served *some* request, which is what the canary
needs to stop trusting the client's word about *which* model answered.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from services.settings import Settings

NONCE_HEX = 24  # 96 random bits
MAC_HEX = 32  # 128 bits of the HMAC: forging one is out of reach


# Whether a trace was served by the version it claims, from that version and its
# ``response_ids`` (the canary's filter: services.db.queries.cycles.live_counts).
TraceAttestation = Callable[[str | None, list[Any]], bool]


def response_id(prefix: str, version: str, key: bytes | None) -> str:
    """A new response id; signed for ``version`` when the server has a key."""
    if key is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    nonce = secrets.token_hex(NONCE_HEX // 2)
    return f"{prefix}-{nonce}{_mac(key, nonce, version)}"


def verifies(response_id: str, version: str, key: bytes) -> bool:
    """Whether ``response_id`` was signed by a server holding ``key`` for ``version``."""
    _, _, signed = response_id.rpartition("-")
    if len(signed) != NONCE_HEX + MAC_HEX:
        return False
    nonce, mac = signed[:NONCE_HEX], signed[NONCE_HEX:]
    return hmac.compare_digest(mac, _mac(key, nonce, version))


def attested(version: str | None, response_ids: Iterable[object], *, key: bytes) -> bool:
    """A trace is attested when it names a version and at least one response id, and every
    id is a string signed for that version (one id of another version, or a made-up one,
    and the trace is the client's word again)."""
    if not version:
        return False
    ids = list(response_ids)
    return bool(ids) and all(isinstance(i, str) and verifies(i, version, key) for i in ids)


def attestation_key(settings: Settings) -> bytes | None:
    """The deployment's attestation key as the HMAC takes it; None when there is none."""
    key = settings.serve_attestation_key
    return key.get_secret_value().encode("utf-8") if key is not None else None


def _mac(key: bytes, nonce: str, version: str) -> str:
    digest = hmac.new(key, f"{nonce}\n{version}".encode(), hashlib.sha256).hexdigest()
    return digest[:MAC_HEX]
