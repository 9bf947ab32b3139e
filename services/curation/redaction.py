"""Redaction: sensitive values never reach a task, only counts of what was removed.

Every string of a task (prompt, tool specs, verifier params, reference answer, metadata) goes
through the rules below, in this order; a match is replaced by ``[REDACTED_<KIND>]`` and
counted per kind. The originals are not kept anywhere.

| kind            | what matches                                                              |
|-----------------|---------------------------------------------------------------------------|
| ``custom_<n>``  | the loop's own patterns (``curation_policy.redact_patterns``), first      |
| ``private_key`` | PEM private key blocks                                                    |
| ``url_password``| the password of ``scheme://user:password@host`` URLs (the rest is kept)   |
| ``bearer_token``| ``Authorization:`` header values, ``Bearer <token>``, JWTs                |
| ``api_key``     | provider-prefixed keys: OpenAI/Anthropic ``sk-``, Stripe, GitHub, GitLab, |
|                 | Slack, AWS ``AKIA``/``ASIA``, Google ``AIza``, Hugging Face, SendGrid, npm |
| ``secret``      | values of ``password=``/``token:``/``api_key=``…, values under such JSON  |
|                 | keys, and high-entropy tokens (random-looking, 20+ characters)            |
| ``email``       | RFC 5322 dot-atom addresses                                               |
| ``national_id`` | SSN-style ``123-45-6789`` / ``123 45 6789`` (invalid area/group/serial    |
|                 | numbers such as ``000``, ``666``, ``9xx``, ``00``, ``0000`` excluded)     |
| ``iban``        | IBANs (2 letters, 2 check digits, 11-30 more; spaces allowed) passing the |
|                 | ISO 13616 mod-97 check                                                    |
| ``card``        | 13-19 digit numbers (spaces or dashes between groups) passing Luhn        |
| ``ip``          | IPv4 and IPv6 addresses (validated by :mod:`ipaddress`)                   |
| ``phone``       | ``+<country>`` numbers, separated 3-3-4 numbers, and numbers without a    |
|                 | ``+``: ``00<country>`` or trunk ``0`` prefixes with separated groups       |
|                 | (``0044 20 7946 0958``, ``030 1234 5678``, ``(0151) 123 4567``); 7-15     |
|                 | digits                                                                    |

Phone and id rules deliberately ignore bare digit runs: tasks are full of numbers
(toolcalc's ``863+395``) and a redacted operand would make the task unverifiable; each
needs its separators (and a phone without ``+`` its leading ``0``). Redaction is
idempotent: placeholders match no rule.

Speed: most strings of a task match nothing. Before the rules run one by one (each a
``re.sub`` pass), one compiled alternation of every built-in pattern is searched; when it
finds nothing no rule can match and the text is returned as is, in one C-level scan instead
of a dozen Python-level passes. When it finds something, the rules run in order as above,
so the result is the same either way.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.curation.policy import CustomPattern


def placeholder(kind: str) -> str:
    return f"[REDACTED_{kind.upper()}]"


@dataclass(frozen=True)
class _Rule:
    """One pattern: ``group`` is the part replaced, ``accept`` can veto a match."""

    kind: str
    regex: re.Pattern[str]
    group: int = 0
    accept: Callable[[str], bool] | None = None
    needs: str | None = None  # a substring without which the rule cannot match (fast skip)


_PRIVATE_KEY = re.compile(
    r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----.*?(?:-----END[A-Z ]{0,40}PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
_AUTH_HEADER = re.compile(
    r"(?i)\b(?:proxy-)?authorization\b[\"']?\s*[:=]\s*[\"']?"
    r"(?:(?:bearer|basic|token|digest)\s+)?([^\s,;\"']{4,})"
)
_BEARER = re.compile(r"(?i)\bbearer\s+([A-Za-z0-9._~+/=-]{8,})")
_JWT = re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
_API_KEY = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-(?:proj-|ant-(?:[a-z]{3}\d{2}-)?)?[A-Za-z0-9_-]{16,}"
    r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}"
    r"|glpat-[A-Za-z0-9_-]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|AIza[0-9A-Za-z_-]{35}"
    r"|hf_[A-Za-z0-9]{30,}"
    r"|SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"
    r"|npm_[A-Za-z0-9]{36}"
    r")"
)
_SECRET_NAME = (
    r"(?:api[_-]?key|api[_-]?secret|secret[_-]?key|client[_-]?secret|access[_-]?key"
    r"|access[_-]?token|auth[_-]?token|refresh[_-]?token|private[_-]?key"
    r"|password|passwd|pwd|secret|token)"
)
_KEY_VALUE_SECRET = re.compile(
    rf"(?i)\b{_SECRET_NAME}\b[\"']?\s*[:=]\s*[\"']?([^\s\"',;&}}]{{4,}})"
)
_SECRET_KEY_NAME = re.compile(rf"(?i)^[\w.-]*{_SECRET_NAME}$")

_LOCAL = r"A-Za-z0-9!#$%&'*+/=?^_`{|}~.-"
_EMAIL = re.compile(rf"(?<![{_LOCAL}])[{_LOCAL}]++@(?:[A-Za-z0-9-]++\.)++[A-Za-z0-9-]{{2,63}}")

_DIGIT_RUN = re.compile(r"(?<![0-9])[0-9](?:[ -]?[0-9]){12,}(?![0-9])")

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"(?<![0-9.])(?:{_OCTET}\.){{3}}{_OCTET}(?!\.?[0-9])")
_IPV6 = re.compile(
    r"(?<![0-9A-Za-z:])(?=[0-9A-Fa-f:]*:[0-9A-Fa-f]*:)[0-9A-Fa-f:]{2,39}"
    r"(?:(?<=:)[0-9]{1,3}(?:\.[0-9]{1,3}){3})?(?:%[0-9A-Za-z]{1,15})?(?![0-9A-Za-z:])"
)
_PHONE_INTL = re.compile(r"(?<![\w+])\+[1-9][0-9]{0,2}(?:[ .-]?\(?[0-9]{1,4}\)?){2,6}(?![0-9])")
_PHONE_NANP = re.compile(
    r"(?<![\w(])(?:\([2-9][0-9]{2}\) ?|[2-9][0-9]{2}[ .-])[0-9]{3}[ .-][0-9]{4}(?![0-9])"
)

_PHONE_NATIONAL = re.compile(
    r"(?<![\w+.(])(?:00[1-9][0-9]{0,2}|0[1-9][0-9]{1,4}|\(0[1-9][0-9]{1,4}\))"
    r"(?:[ .-][0-9]{2,5}){1,4}(?![0-9]|[.-][0-9])"
)
_URL_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]{0,30}://[^\s/?#@:]{0,256}:([^\s/?#@]{1,256})@")
_NATIONAL_ID = re.compile(
    r"(?<![0-9-])(?!000|666|9[0-9]{2})[0-9]{3}(?:-(?!00)[0-9]{2}-| (?!00)[0-9]{2} )"
    r"(?!0000)[0-9]{4}(?![0-9]|-[0-9])"
)
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11,30}(?![A-Za-z0-9])")

_TOKEN = re.compile(r"(?<![A-Za-z0-9_+/=-])[A-Za-z0-9_+/=-]{20,}")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_PATH_PART = re.compile(r"^[a-z0-9._-]*$")


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number carries."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if index % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def shannon_entropy(text: str) -> float:
    """Bits per character of ``text``'s own character distribution."""
    if not text:
        return 0.0
    length = len(text)
    return -sum(n / length * math.log2(n / length) for n in Counter(text).values())


def looks_random(token: str) -> bool:
    """True for tokens that read like generated secrets rather than words or paths.

    The entropy is compared with the most a string of that length and alphabet could have
    (hex: 4 bits, base64-ish: 6 bits): natural identifiers repeat letters and stay
    below that share, random keys sit above. Lowercase paths (``api/v1/users``) and UUIDs
    are identifiers, not secrets.
    """
    core = token.strip("=-_")
    if len(core) < 20 or _UUID.match(core) or core.startswith("REDACTED_"):
        return False
    if "/" in core and all(_PATH_PART.match(p) for p in core.split("/")):
        return False
    alphabet = 16 if _HEX.match(core) else 64
    ceiling = math.log2(min(len(core), alphabet))
    has_digit = any(c.isdigit() for c in core)
    has_letter = any(c.isalpha() for c in core)
    if not has_letter:
        return False
    factor = 0.8 if has_digit else 0.85
    return shannon_entropy(core) >= factor * ceiling


def _not_placeholder(value: str) -> bool:
    return not value.startswith("[REDACTED_")


def _valid_ipv6(candidate: str) -> bool:
    if candidate.count(":") < 2 or sum(1 for p in candidate.split(":") if p) < 2:
        return False
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


def _phone_digits_ok(candidate: str) -> bool:
    return 7 <= sum(c.isdigit() for c in candidate) <= 15


def iban_valid(candidate: str) -> bool:
    """ISO 13616: 15-34 characters whose rearranged digits are 1 modulo 97."""
    compact = candidate.replace(" ", "")
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    digits = "".join(str(int(c, 36)) for c in rearranged)
    return int(digits) % 97 == 1


_BUILTIN_RULES: tuple[_Rule, ...] = (
    _Rule("private_key", _PRIVATE_KEY, needs="PRIVATE KEY"),
    _Rule("url_password", _URL_PASSWORD, group=1, accept=_not_placeholder, needs="://"),
    _Rule("bearer_token", _AUTH_HEADER, group=1, accept=_not_placeholder),
    _Rule("bearer_token", _BEARER, group=1),
    _Rule("bearer_token", _JWT, needs="eyJ"),
    _Rule("api_key", _API_KEY),
    _Rule("secret", _KEY_VALUE_SECRET, group=1, accept=_not_placeholder),
    _Rule("email", _EMAIL, needs="@"),
)
# Numbers with a structure of their own, before the card rule can cut a card out of them.
_ID_RULES: tuple[_Rule, ...] = (_Rule("national_id", _NATIONAL_ID),)
_NETWORK_RULES: tuple[_Rule, ...] = (
    _Rule("ip", _IPV6, accept=_valid_ipv6, needs=":"),
    _Rule("ip", _IPV4, needs="."),
    _Rule("phone", _PHONE_INTL, accept=_phone_digits_ok, needs="+"),
    _Rule("phone", _PHONE_NANP),
    _Rule("phone", _PHONE_NATIONAL, accept=_phone_digits_ok, needs="0"),
)
_ENTROPY_RULE = _Rule("secret", _TOKEN, accept=looks_random)


def _scoped(pattern: re.Pattern[str]) -> str:
    """``pattern`` as a group that keeps its own flags, to sit in an alternation."""
    source = re.sub(r"^\(\?[aiLmsux]+\)", "", pattern.pattern)
    letters = "".join(
        letter
        for flag, letter in ((re.IGNORECASE, "i"), (re.DOTALL, "s"), (re.MULTILINE, "m"))
        if pattern.flags & flag
    )
    return f"(?{letters}:{source})" if letters else f"(?:{source})"


# Any match of any built-in rule (and of the card rule's digit runs) is a match of this.
_ANY_BUILTIN = re.compile(
    "|".join(
        _scoped(rule.regex)
        for rule in (*_BUILTIN_RULES, *_ID_RULES, *_NETWORK_RULES, _ENTROPY_RULE)
    )
    + "|"
    + _scoped(_IBAN)
    + "|"
    + _scoped(_DIGIT_RUN)
)

# Every built-in rule needs one of these to match: text without any is returned untouched.
_TRIGGER = re.compile(
    r"[0-9@]|::|[A-Za-z0-9_+/=.-]{16}|(?i:key|secret|token|pass|pwd|bearer|authoriz|private|xox)"
)
_CACHE_MAX_LEN = 256
_SCALARS = frozenset({int, float, bool, type(None)})
_CACHE_SIZE = 16_384


@dataclass(frozen=True)
class Redacted:
    """A redacted value and how many of each kind were removed from it."""

    value: Any
    counts: dict[str, int]


class Redactor:
    """Applies the built-in rules plus a loop's custom patterns to text and JSON values.

    Short strings repeat a lot across traces (tool specs, schema words), so their results
    are cached per redactor; text that contains none of the characters or words any
    built-in rule needs skips the rules entirely.
    """

    def __init__(
        self, custom_patterns: Sequence[CustomPattern] = (), *, high_entropy: bool = True
    ) -> None:
        self._custom = tuple(
            _Rule(f"custom_{p.name}", re.compile(p.pattern)) for p in custom_patterns
        )
        self._tail = (_ENTROPY_RULE,) if high_entropy else ()
        self._cached = functools.lru_cache(maxsize=_CACHE_SIZE)(self._redact_short)
        self._shared: dict[str, tuple[Any, tuple[tuple[str, int], ...]]] = {}

    def redact_text(self, text: str, counts: Counter[str]) -> str:
        """``text`` with every sensitive value replaced; ``counts`` is increased per kind."""
        if len(text) > _CACHE_MAX_LEN:
            return self._redact(text, counts)
        result, found = self._cached(text)
        for kind, n in found:
            counts[kind] += n
        return result

    def _redact_short(self, text: str) -> tuple[str, tuple[tuple[str, int], ...]]:
        counts: Counter[str] = Counter()
        result = self._redact(text, counts)
        return result, tuple(counts.items())

    def _redact(self, text: str, counts: Counter[str]) -> str:
        for rule in self._custom:
            text = _apply(rule, text, counts)
        if _TRIGGER.search(text) is None or _ANY_BUILTIN.search(text) is None:
            return text
        for rule in _BUILTIN_RULES:
            text = _apply(rule, text, counts)
        if any(c.isdigit() for c in text):
            for rule in _ID_RULES:
                text = _apply(rule, text, counts)
            text = _redact_ibans(text, counts)
            text = _redact_cards(text, counts)
            for rule in _NETWORK_RULES:
                text = _apply(rule, text, counts)
        for rule in self._tail:
            text = _apply(rule, text, counts)
        return text

    def redact_value(self, value: Any, counts: Counter[str]) -> Any:
        """A copy of a JSON value with every string (keys included) redacted.

        A string under a key that names a secret (``password``, ``api_key``, ``token`` …) is
        replaced whole: the key says what it is even when its shape does not.
        """
        kind = type(value)
        if kind is str:
            return self.redact_text(value, counts)
        if kind in _SCALARS:
            return value
        if kind is dict or isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for key, item in value.items():
                new_key = self.redact_text(str(key), counts)
                while new_key in out:
                    new_key += "_"
                if isinstance(item, str) and item and _SECRET_KEY_NAME.match(str(key)):
                    counts["secret"] += 1
                    out[new_key] = placeholder("secret")
                else:
                    out[new_key] = self.redact_value(item, counts)
            return out
        if kind is list or isinstance(value, list | tuple):
            return [self.redact_value(item, counts) for item in value]
        if isinstance(value, str):
            return self.redact_text(value, counts)
        return value

    def redact_shared(self, value: Any, counts: Counter[str], *, key: str | None = None) -> Any:
        """:meth:`redact_value` for values that repeat across traces (a loop's tool specs),
        cached by their canonical JSON (``key``, when the caller has already encoded it).
        The result must not be mutated."""
        if key is None:
            key = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
        cached = self._shared.get(key)
        if cached is None:
            found: Counter[str] = Counter()
            cached = (self.redact_value(value, found), tuple(found.items()))
            if len(self._shared) < _CACHE_SIZE:
                self._shared[key] = cached
        for kind, n in cached[1]:
            counts[kind] += n
        return cached[0]

    def redact(self, value: Any) -> Redacted:
        counts: Counter[str] = Counter()
        redacted = self.redact_value(value, counts)
        return Redacted(redacted, dict(counts))


def _apply(rule: _Rule, text: str, counts: Counter[str]) -> str:
    if rule.needs is not None and rule.needs not in text:
        return text
    token = placeholder(rule.kind)

    def replace(match: re.Match[str]) -> str:
        whole = match.group(0)
        secret = match.group(rule.group)
        if not secret or (rule.accept is not None and not rule.accept(secret)):
            return whole
        counts[rule.kind] += 1
        if rule.group == 0:
            return token
        start, end = match.span(rule.group)
        offset = match.start(0)
        return whole[: start - offset] + token + whole[end - offset :]

    return rule.regex.sub(replace, text)


def _redact_ibans(text: str, counts: Counter[str]) -> str:
    """Replace IBANs that pass the mod-97 check.

    The pattern is greedy (an IBAN printed in groups may be followed by more capitals and
    digits), so a candidate that fails the check is shortened one group at a time, from the
    right, until one passes or it is too short to be an IBAN; a candidate that never passes
    is searched again from its second character (an IBAN may start inside it).
    """
    pieces: list[str] = []
    last = 0
    position = 0
    while (match := _IBAN.search(text, position)) is not None:
        candidate = match.group(0)
        while len(candidate.replace(" ", "")) >= 15 and not iban_valid(candidate):
            cut = candidate.rfind(" ")
            candidate = candidate[:cut] if cut > 4 else ""
        if len(candidate.replace(" ", "")) < 15:
            position = match.start() + 1
            continue
        pieces += [text[last : match.start()], placeholder("iban")]
        counts["iban"] += 1
        last = position = match.start() + len(candidate)
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def _redact_cards(text: str, counts: Counter[str]) -> str:
    """Replace Luhn-valid 13-19 digit card numbers, including ones inside longer digit runs.

    A card may start or end only at a group boundary (the run's ends or next to a space or
    dash), so a bare 30-digit number is never cut into a "card". Among the valid windows of
    a run, 16-digit ones win, then longer ones, so a card next to unrelated digits is still
    removed whole.
    """
    pieces: list[str] = []
    last = 0
    for match in _DIGIT_RUN.finditer(text):
        windows = _card_windows(match.group(0))
        if not windows:
            continue
        base = match.start()
        for start, end in windows:
            pieces.append(text[last : base + start])
            pieces.append(placeholder("card"))
            counts["card"] += 1
            last = base + end
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def _card_windows(run: str) -> list[tuple[int, int]]:
    digit_positions = [i for i, c in enumerate(run) if c.isdigit()]
    starts = [i for i in digit_positions if i == 0 or not run[i - 1].isdigit()]
    ends = [i + 1 for i in digit_positions if i + 1 == len(run) or not run[i + 1].isdigit()]
    index_of = {pos: n for n, pos in enumerate(digit_positions)}
    candidates: list[tuple[int, int, int]] = []
    for start in starts:
        first = index_of[start]
        for end in ends:
            count = index_of[end - 1] - first + 1
            if 13 <= count <= 19:
                digits = "".join(run[p] for p in digit_positions[first : first + count])
                if luhn_valid(digits):
                    candidates.append((count, start, end))
    candidates.sort(key=lambda c: (c[0] != 16, -c[0], c[1]))
    chosen: list[tuple[int, int]] = []
    for _, start, end in candidates:
        if all(end <= s or start >= e for s, e in chosen):
            chosen.append((start, end))
    return sorted(chosen)
