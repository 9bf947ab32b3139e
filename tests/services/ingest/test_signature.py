"""Standard Webhooks compatibility: the package's published test vectors and the package itself."""

from __future__ import annotations

import base64
import datetime as dt
import json

import pytest
from standardwebhooks.webhooks import Webhook

from services.ingest.signature import (
    SignatureError,
    generate_secret,
    parse_headers,
    secret_key,
    sign,
    verify,
)

# From standard-webhooks/libraries/python/tests/test_webhooks.py (test_sign_function).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_PAYLOAD = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def headers(msg_id: str, timestamp: int, signature: str) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
    }


def test_sign_matches_the_published_vector() -> None:
    assert sign(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_PAYLOAD) == VECTOR_SIGNATURE
    # The prefix is optional, as in the reference library.
    assert sign(
        VECTOR_SECRET.removeprefix("whsec_"), VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_PAYLOAD
    ) == (VECTOR_SIGNATURE)


def test_verify_accepts_the_published_vector_at_its_time() -> None:
    signed = parse_headers(
        headers(VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_SIGNATURE),
        now=VECTOR_TIMESTAMP + 10,
        tolerance_s=300,
    )
    assert verify(signed, VECTOR_PAYLOAD, [secret_key(VECTOR_SECRET)])
    assert not verify(signed, VECTOR_PAYLOAD + b" ", [secret_key(VECTOR_SECRET)])
    # The vector's tampered signature (last character changed) is refused.
    tampered = parse_headers(
        headers(VECTOR_ID, VECTOR_TIMESTAMP, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="),
        now=VECTOR_TIMESTAMP,
        tolerance_s=300,
    )
    assert not verify(tampered, VECTOR_PAYLOAD, [secret_key(VECTOR_SECRET)])


def test_the_reference_library_verifies_our_signatures_and_we_verify_its() -> None:
    secret = generate_secret()
    now = dt.datetime.now(dt.UTC)
    payload = json.dumps({"traces": [{"x": "ü"}]})
    theirs = Webhook(secret).sign("msg_1", now, payload)
    ours = sign(secret, "msg_1", int(now.timestamp()), payload.encode())
    assert ours == theirs
    assert Webhook(secret).verify(payload, headers("msg_1", int(now.timestamp()), ours))
    signed = parse_headers(
        headers("msg_1", int(now.timestamp()), theirs), now=now.timestamp(), tolerance_s=300
    )
    assert verify(signed, payload.encode(), [secret_key(secret)])


def test_secrets_are_whsec_base64_of_32_random_bytes() -> None:
    secret = generate_secret()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    assert generate_secret() != secret
    with pytest.raises(ValueError):
        secret_key("whsec_not*base64")


def test_any_active_key_and_any_v1_signature_may_match() -> None:
    old, new = generate_secret(), generate_secret()
    body = b"{}"
    signature = sign(new, "m", 1000, body)
    signed = parse_headers(
        headers("m", 1000, f"v2,xyz v1,AAAA {signature}"), now=1000, tolerance_s=300
    )
    assert verify(signed, body, [secret_key(old), secret_key(new)])
    assert not verify(signed, body, [secret_key(old)])
    assert not verify(signed, body, [])


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"webhook-timestamp": "1000", "webhook-signature": "v1,AAAA"}, "missing"),
        ({"webhook-id": "m", "webhook-signature": "v1,AAAA"}, "missing"),
        ({"webhook-id": "m", "webhook-timestamp": "1000"}, "missing"),
        (
            {"webhook-id": "m", "webhook-timestamp": "1e3", "webhook-signature": "v1,AAAA"},
            "whole seconds",
        ),
        ({"webhook-id": "m", "webhook-timestamp": "699", "webhook-signature": "v1,AAAA"}, "301 s"),
        (
            {"webhook-id": "m", "webhook-timestamp": "1301", "webhook-signature": "v1,AAAA"},
            "-301 s",
        ),
        ({"webhook-id": "m", "webhook-timestamp": "1000", "webhook-signature": "v2,AAAA"}, "no v1"),
        ({"webhook-id": "m", "webhook-timestamp": "1000", "webhook-signature": "v1,***"}, "no v1"),
        (
            {"webhook-id": "m" * 300, "webhook-timestamp": "1000", "webhook-signature": "v1,AA"},
            "longer",
        ),
    ],
)
def test_malformed_or_stale_headers_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(SignatureError, match=message):
        parse_headers(given, now=1000, tolerance_s=300)


def test_the_tolerance_is_inclusive_both_ways() -> None:
    for timestamp in (700, 1300):
        signed = parse_headers(headers("m", timestamp, "v1,AAAA"), now=1000, tolerance_s=300)
        assert signed.timestamp == timestamp
