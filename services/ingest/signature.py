"""Standard Webhooks signatures: HMAC-SHA256 over ``id.timestamp.body``, base64, ``v1,`` prefix.

The verifier is ours rather than ``standardwebhooks.Webhook.verify`` because the server needs
what the package does not give: bytes bodies (no UTF-8 decoding before authentication), a
configurable tolerance, several secrets at once during a rotation, and an injectable clock.
Compatibility with the package and its published test vectors is proven in
tests/services/ingest/test_signature.py. Comparisons are constant-time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SECRET_PREFIX = "whsec_"
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
MAX_ID_LENGTH = 256


class SignatureError(Exception):
    """The request is not signed correctly; the message says which part is at fault."""


def generate_secret(num_bytes: int = 32) -> str:
    """A new signing secret, ``whsec_`` + base64 of random bytes (24..64 bytes per the spec)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(num_bytes)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_...`` secret (the prefix is optional)."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError("a signing secret must be whsec_ followed by base64") from exc
    if not key:
        raise ValueError("a signing secret may not be empty")
    return key


def _digest(key: bytes, msg_id: str, timestamp: int, body: bytes) -> bytes:
    return hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for a body (``v1,<base64>``)."""
    digest = _digest(secret_key(secret), msg_id, timestamp, body)
    return "v1," + base64.b64encode(digest).decode("ascii")


@dataclass(frozen=True)
class SignedHeaders:
    """The three Standard Webhooks headers, checked for form and freshness."""

    msg_id: str
    timestamp: int
    signatures: tuple[bytes, ...]


def parse_headers(headers: Mapping[str, str], *, now: float, tolerance_s: float) -> SignedHeaders:
    """Check the headers before the body is read: present, well formed, timestamp fresh.

    The timestamp must be within ``tolerance_s`` of ``now`` in both directions, which bounds
    how long a captured request can be replayed.
    """
    msg_id = headers.get("webhook-id")
    raw_timestamp = headers.get("webhook-timestamp")
    raw_signature = headers.get("webhook-signature")
    if not msg_id or not raw_timestamp or not raw_signature:
        raise SignatureError(
            "missing signature headers: webhook-id, webhook-timestamp and webhook-signature "
            "are required (Standard Webhooks)"
        )
    if len(msg_id) > MAX_ID_LENGTH:
        raise SignatureError(f"webhook-id is longer than {MAX_ID_LENGTH} characters")
    if not _TIMESTAMP.match(raw_timestamp.strip()):
        raise SignatureError("webhook-timestamp must be whole seconds since the Unix epoch")
    timestamp = int(raw_timestamp.strip())
    if abs(now - timestamp) > tolerance_s:
        raise SignatureError(
            f"webhook-timestamp is {int(now - timestamp)} s from the server's clock; at most "
            f"{int(tolerance_s)} s either way are accepted (check the sender's clock)"
        )
    signatures = []
    for entry in raw_signature.split():
        version, _, value = entry.partition(",")
        if version != "v1" or not value:
            continue
        try:
            signatures.append(base64.b64decode(value, validate=True))
        except binascii.Error:
            continue
    if not signatures:
        raise SignatureError("webhook-signature holds no v1,<base64> signature")
    return SignedHeaders(msg_id=msg_id, timestamp=timestamp, signatures=tuple(signatures))


def verify(signed: SignedHeaders, body: bytes, keys: Iterable[bytes]) -> bool:
    """Whether any given signature matches the body under any active key (constant-time)."""
    matched = False
    for key in keys:
        expected = _digest(key, signed.msg_id, signed.timestamp, body)
        for candidate in signed.signatures:
            # No early exit: the time taken does not say which key or signature matched.
            matched |= hmac.compare_digest(expected, candidate)
    return matched
