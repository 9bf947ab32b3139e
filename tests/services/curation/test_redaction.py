"""Redaction: seeded secrets never survive, counts are kept, ordinary task text is left alone."""

from __future__ import annotations

import base64
import hashlib
import re
import string
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.curation import redaction
from services.curation.policy import CustomPattern
from services.curation.redaction import Redactor, iban_valid, looks_random, luhn_valid

REDACTOR = Redactor()
ALNUM = string.ascii_letters + string.digits


def _luhn_complete(body: str) -> str:
    for check in "0123456789":
        if luhn_valid(body + check):
            return body + check
    raise AssertionError("unreachable")


@st.composite
def card_numbers(draw: st.DrawFn) -> str:
    length = draw(st.sampled_from([15, 16, 16, 16, 19]))
    first = draw(st.sampled_from("3456"))
    body = first + draw(st.text(alphabet=string.digits, min_size=length - 2, max_size=length - 2))
    digits = _luhn_complete(body)
    separator = draw(st.sampled_from(["", " ", "-"]))
    if length == 15:
        groups = [digits[:4], digits[4:10], digits[10:]]
    else:
        groups = [digits[i : i + 4] for i in range(0, length, 4)]
    return separator.join(groups)


def _alnum(n: int, m: int | None = None) -> st.SearchStrategy[str]:
    return st.text(alphabet=ALNUM, min_size=n, max_size=m if m is not None else n)


def _random_from(seed: bytes, *, encoding: str) -> str:
    digest = hashlib.sha512(seed).digest()
    return digest.hex()[:64] if encoding == "hex" else base64.b64encode(digest).decode()


api_keys = st.one_of(
    _alnum(20, 48).map(lambda s: "sk-" + s),
    _alnum(20, 48).map(lambda s: "sk-proj-" + s),
    _alnum(24, 40).map(lambda s: "sk-ant-api03-" + s),
    _alnum(36).map(lambda s: "ghp_" + s),
    _alnum(40, 60).map(lambda s: "github_pat_" + s),
    st.text(alphabet=string.ascii_uppercase + string.digits, min_size=16, max_size=16).map(
        lambda s: "AKIA" + s
    ),
    _alnum(24, 32).map(lambda s: "sk_live_" + s),
    _alnum(20, 40).map(lambda s: "xoxb-1234-" + s),
    st.text(alphabet=ALNUM + "_-", min_size=35, max_size=35).map(lambda s: "AIza" + s),
    _alnum(34).map(lambda s: "hf_" + s),
    _alnum(20, 32).map(lambda s: "glpat-" + s),
    st.binary(min_size=1, max_size=32).map(lambda b: _random_from(b, encoding="hex")),
    st.binary(min_size=1, max_size=32).map(lambda b: _random_from(b, encoding="base64")),
)


@st.composite
def national_ids(draw: st.DrawFn) -> str:
    area = draw(st.integers(1, 899).filter(lambda n: n != 666))
    group = draw(st.integers(1, 99))
    serial = draw(st.integers(1, 9999))
    separator = draw(st.sampled_from("- "))
    return f"{area:03d}{separator}{group:02d}{separator}{serial:04d}"


@st.composite
def ibans(draw: st.DrawFn) -> str:
    country = draw(st.sampled_from(["DE", "FR", "GB", "NL", "ES", "IT", "CH"]))
    bban = draw(st.text(alphabet=string.digits + string.ascii_uppercase, min_size=12, max_size=26))
    numeric = "".join(str(int(c, 36)) for c in bban + country + "00")
    iban = f"{country}{98 - int(numeric) % 97:02d}{bban}"
    if draw(st.booleans()):
        iban = " ".join(iban[i : i + 4] for i in range(0, len(iban), 4))
    return iban


@st.composite
def phones_without_plus(draw: st.DrawFn) -> str:
    prefix = draw(
        st.one_of(
            st.integers(1, 999).map(lambda n: f"00{n}"),
            st.integers(10, 9999).map(lambda n: f"0{n}"),
            st.integers(10, 9999).map(lambda n: f"(0{n})"),
        )
    )
    groups = draw(
        st.lists(st.text(alphabet=string.digits, min_size=3, max_size=4), min_size=2, max_size=3)
    )
    separator = draw(st.sampled_from(" -."))
    number = prefix + separator + separator.join(groups)
    digits = sum(c.isdigit() for c in number)
    return number if 7 <= digits <= 15 else number[: number.rfind(separator)]


url_passwords = st.tuples(
    st.sampled_from(["postgres", "https", "redis", "amqp", "mongodb+srv"]),
    _alnum(1, 12),
    st.text(alphabet=ALNUM + "!$%^*()_-~", min_size=1, max_size=24),
    st.sampled_from(["db.example.com", "10.1.2.3:5432", "cache"]),
).map(lambda p: (f"{p[0]}://{p[1]}:{p[2]}@{p[3]}/x", p[2]))

bearer_tokens = st.text(alphabet=ALNUM + "._-", min_size=8, max_size=60).map(
    lambda t: ("Authorization: Bearer " + t, t)
)
filler = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=40
)


@settings(max_examples=150, deadline=None)
@given(
    secrets=st.lists(st.one_of(st.emails(), api_keys, card_numbers()), min_size=1, max_size=4),
    padding=st.lists(filler, min_size=5, max_size=5),
)
def test_no_seeded_email_key_or_card_survives(secrets: list[str], padding: list[str]) -> None:
    parts = [padding[0]]
    for index, secret in enumerate(secrets):
        parts += [" ", secret, " ", padding[(index + 1) % len(padding)]]
    text = "".join(parts)
    counts: Counter[str] = Counter()
    redacted = REDACTOR.redact_text(text, counts)
    for secret in secrets:
        assert secret not in redacted
    assert sum(counts.values()) >= len(set(secrets)) - sum(
        1 for s in secrets if any(s in other for other in secrets if other != s)
    )


@settings(max_examples=100, deadline=None)
@given(token=bearer_tokens, before=filler, after=filler)
def test_bearer_tokens_never_survive(token: tuple[str, str], before: str, after: str) -> None:
    header, secret = token
    redacted = REDACTOR.redact_text(f"{before}\n{header}\n{after}", Counter())
    assert f"Bearer {secret}" not in redacted


@settings(max_examples=100, deadline=None)
@given(secret=st.one_of(st.emails(), api_keys, card_numbers()), key=st.sampled_from(["a", "b"]))
def test_secrets_inside_json_values_never_survive(secret: str, key: str) -> None:
    value = {key: [{"text": f"contact {secret} now"}], "n": 3, "ok": True, "none": None}
    result = REDACTOR.redact(value)
    assert secret not in repr(result.value)
    assert result.value["n"] == 3 and result.value["ok"] is True and result.value["none"] is None
    assert sum(result.counts.values()) >= 1


@settings(max_examples=200, deadline=None)
@given(
    secret=st.one_of(national_ids(), ibans(), phones_without_plus()),
    before=filler.map(lambda f: f.rstrip("0123456789-+.(")),
    after=filler.map(lambda f: f.lstrip("0123456789-.")),
)
def test_no_seeded_national_id_iban_or_phone_survives(secret: str, before: str, after: str) -> None:
    counts: Counter[str] = Counter()
    redacted = REDACTOR.redact_text(f"{before} {secret} {after}", counts)
    assert secret not in redacted
    assert counts


@settings(max_examples=150, deadline=None)
@given(url=url_passwords, before=filler, after=filler)
def test_passwords_in_urls_never_survive(url: tuple[str, str], before: str, after: str) -> None:
    text, password = url
    counts: Counter[str] = Counter()
    redacted = REDACTOR.redact_text(f"{before} {text} {after}", counts)
    assert f":{password}@" not in redacted
    assert counts["url_password"] == 1


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(
        st.one_of(
            filler,
            st.emails(),
            api_keys,
            card_numbers(),
            national_ids(),
            ibans(),
            phones_without_plus(),
            url_passwords.map(lambda u: u[0]),
            st.text(alphabet=string.digits + " -.+()", max_size=30),
        ),
        max_size=6,
    ).map(" ".join)
)
def test_the_one_pass_prefilter_changes_nothing(text: str) -> None:
    """The rules run one by one whenever the combined pattern is bypassed: same result."""
    fast: Counter[str] = Counter()
    slow: Counter[str] = Counter()
    expected = redaction_without_prefilter(text, slow)
    assert Redactor()._redact(text, fast) == expected
    assert fast == slow


def redaction_without_prefilter(text: str, counts: Counter[str]) -> str:
    original = redaction._ANY_BUILTIN
    redaction._ANY_BUILTIN = re.compile("")
    try:
        return Redactor()._redact(text, counts)
    finally:
        redaction._ANY_BUILTIN = original


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_redaction_is_idempotent(text: str) -> None:
    once = REDACTOR.redact_text(text, Counter())
    again: Counter[str] = Counter()
    assert REDACTOR.redact_text(once, again) == once
    assert not again


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("write to alice.smith+tag@example.co.uk today", "email"),
        ("call +1 (555) 123-4567", "phone"),
        ("call 555-123-4567", "phone"),
        ("call +44 20 7946 0958", "phone"),
        ("call 0044 20 7946 0958", "phone"),
        ("call 030 1234 5678", "phone"),
        ("ring (0151) 123-4567 after six", "phone"),
        ("ssn 123-45-6789 on file", "national_id"),
        ("ssn 078 05 1120 on file", "national_id"),
        ("pay to DE89 3704 0044 0532 0130 00 today", "iban"),
        ("pay to GB82WEST12345698765432 today", "iban"),
        ("dsn postgres://admin:s3cr3t-Pa55@db.internal:5432/app", "url_password"),
        ("card 4111 1111 1111 1111", "card"),
        ("amex 3782 822463 10005", "card"),
        ("host 10.0.0.1 answered", "ip"),
        ("host 2001:db8::8a2e:370:7334 answered", "ip"),
        ("key AKIAIOSFODNN7EXAMPLE in the log", "api_key"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "bearer_token"),
        (
            "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
            "bearer_token",
        ),
        ("password=hunter22", "secret"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "private_key"),
        ("token Zq8vR2mX9pL4kT7wB3nY6cF1hJ5dS0aG here", "secret"),
    ],
)
def test_each_kind_is_redacted_and_counted(text: str, kind: str) -> None:
    counts: Counter[str] = Counter()
    redacted = REDACTOR.redact_text(text, counts)
    assert f"[REDACTED_{kind.upper()}]" in redacted
    assert counts[kind] == 1


@pytest.mark.parametrize(
    "text",
    [
        "tools: +plus(a,b) *times(a,b) $price(item)\nuser: 863+395\n",
        "user: $pear*37 = 444",
        "order 1234567890123456789012345 shipped",  # a long number is not a card
        "4111111111111112 fails Luhn",
        "meet at 12:30:45, version v2 of std::vector",
        "see /usr/local/lib/python3.11/site-packages/pkg/module.py",
        "id 550e8400-e29b-41d4-a716-446655440000",
        "InternationalBusinessMachines getUserAccountSettingsById",
        "the token expired",
        "000-12-3456 and 666-12-3456 are no SSNs, nor is 123-00-4567",
        "NL91ABNA0417164301 fails mod 97",
        "on 2024-01-15 at 10.30, release 0.12.3, 01-15-2024",
        "https://example.com/path?q=1 and mailto-free user@ text",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    counts: Counter[str] = Counter()
    assert REDACTOR.redact_text(text, counts) == text
    assert not counts


def test_values_under_secret_keys_are_replaced_whole() -> None:
    result = REDACTOR.redact({"password": "x", "api_key": "abc", "user": {"Auth_Token": "t0k"}})
    assert result.value == {
        "password": "[REDACTED_SECRET]",
        "api_key": "[REDACTED_SECRET]",
        "user": {"Auth_Token": "[REDACTED_SECRET]"},
    }
    assert result.counts == {"secret": 3}


def test_custom_patterns_run_first_and_are_counted_by_name() -> None:
    redactor = Redactor([CustomPattern("order_id", r"ORD-\d{6}")])
    result = redactor.redact({"note": "refund ORD-123456 to bob@example.com"})
    assert result.value == {"note": "refund [REDACTED_CUSTOM_ORDER_ID] to [REDACTED_EMAIL]"}
    assert result.counts == {"custom_order_id": 1, "email": 1}


def test_high_entropy_detection_can_be_turned_off() -> None:
    token = "Zq8vR2mX9pL4kT7wB3nY6cF1hJ5dS0aG"
    assert looks_random(token)
    assert Redactor(high_entropy=False).redact_text(f"x {token}", Counter()) == f"x {token}"


def test_luhn() -> None:
    assert luhn_valid("4111111111111111")
    assert luhn_valid("378282246310005")
    assert not luhn_valid("4111111111111112")


def test_iban_check() -> None:
    assert iban_valid("DE89 3704 0044 0532 0130 00")
    assert iban_valid("GB82WEST12345698765432")
    assert not iban_valid("GB82WEST12345698765433")
    assert not iban_valid("DE89 3704")


def test_an_iban_right_after_capitals_and_digits_is_found() -> None:
    counts: Counter[str] = Counter()
    text = "ref AA00A DE89 3704 0044 0532 0130 00 paid"
    assert REDACTOR.redact_text(text, counts) == "ref AA00A [REDACTED_IBAN] paid"
    assert counts == {"iban": 1}
