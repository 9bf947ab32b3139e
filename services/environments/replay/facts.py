"""The ``facts`` rule: an answer passes when it states every checkable fact of the reference.

A free-text reference ("Your connection LX318 leaves 14:05 from gate D4; it is a 11 minute
walk.") is not matched as a whole: a person accepts "LX318 departs at 14:05 from D4, an
11-minute walk" because every fact is there. At curation :func:`extract_facts` reads the
reference's facts once, and the task stores them (``verifier.params.reward.match.facts``),
so the check travels with the task and ``ratchet tasks show`` can print it. Six kinds, each
with the value it is compared by (the *normal form*):

- ``time``: ``14:05``, ``2:05 pm``, ``2:05 PM``, ``2 p.m.`` -> ``14:05`` (24-hour);
- ``date``: ``2026-12-04``, ``2026/12/04``, ``4 December 2026``, ``December 4th, 2026``,
  ``Dec 4``, ``Friday, 4 Dec`` -> ``2026-12-04`` (``--12-04`` without a year, ``2026-12``
  without a day). An answer that leaves out a year the reference has still states the date;
  slashed day/month dates (``12/04/2026``) are ambiguous and read as numbers;
- ``number`` with its unit: ``11 minutes``, ``11-minute``, ``eleven-minute`` -> ``11
  minute``; ``€19.90``, ``19.9 EUR``, ``19,90 €`` -> ``19.9 EUR``; ``15%``, ``15 percent`` ->
  ``15 %``; ``1,234`` is 1234. Units come from a small table (:data:`UNITS`: time, distance,
  mass, volume, data, percent, five currencies); a word after a number that is not in it is
  not a unit (``3 overdue loans`` is the number 3). A number with a unit needs the same
  value in the same unit; one without needs the value. Spelled numbers count only before a
  unit (``one of them`` is no fact);
- ``code``: identifiers that mix letters and digits, or all-capital words of two letters or
  more (``LX318``, ``D4``, ``PT-1002``, ``ZRH``); compared without case or separators
  (``pt 1002`` = ``PT-1002``);
- ``quote``: text in quotation marks, found in the answer with or without its marks;
- ``name``: capitalised words that do not start a sentence (``Elm Street``, ``Friday``), with
  the stop words of :data:`NAME_STOP_WORDS` left out (pronouns, greetings, ``Please``); a
  capitalised word right before a code labels it (``Gate D4``) and is not a name. Words and
  quotes are compared case-folded, word by word.

**Hedging.** An answer that states more distinct values of a kind than the reference does
("14:05 or 15:10") has not said which one it means. Kinds for this count are: times, dates
(by month and day), numbers of each unit (unit-less numbers are one kind), and codes of each
shape (runs of letters and digits: ``D4`` and ``LX318`` are both letters-then-digits); only
kinds the reference holds are counted (an extra time in an answer whose reference has none
is not a hedge). Every fact of a hedged kind earns no credit, so a hedged answer never
passes and keeps the credit of its other facts.

**Score.** :func:`score_facts` returns the fraction of the reference's facts the answer
states (credited facts / all facts), which is the reward's total: partial credit below the
pass, which needs every fact. A reference with no fact cannot use this rule (curation gives
it to the judge or rejects it as ``no_checkable_facts``): a rule that passes every answer
would teach nothing.

Every pattern here is linear (no nested quantifiers), and answers are capped by the caller.
"""

from __future__ import annotations

import calendar
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

FactKind = Literal["number", "time", "date", "code", "quote", "name"]
FACT_KINDS: tuple[FactKind, ...] = ("number", "time", "date", "code", "quote", "name")
MAX_FACTS = 50
_MAX_FIELD = 500

UNITS: dict[str, str] = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "second"),
    **dict.fromkeys(("min", "mins", "minute", "minutes"), "minute"),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), "hour"),
    **dict.fromkeys(("day", "days"), "day"),
    **dict.fromkeys(("week", "weeks", "wk", "wks"), "week"),
    **dict.fromkeys(("month", "months"), "month"),
    **dict.fromkeys(("year", "years", "yr", "yrs"), "year"),
    **dict.fromkeys(("mm", "millimetre", "millimetres", "millimeter", "millimeters"), "mm"),
    **dict.fromkeys(("cm", "centimetre", "centimetres", "centimeter", "centimeters"), "cm"),
    **dict.fromkeys(("m", "metre", "metres", "meter", "meters"), "m"),
    **dict.fromkeys(("km", "kilometre", "kilometres", "kilometer", "kilometers"), "km"),
    **dict.fromkeys(("mi", "mile", "miles"), "mile"),
    **dict.fromkeys(("ft", "foot", "feet"), "ft"),
    **dict.fromkeys(("g", "gram", "grams"), "g"),
    **dict.fromkeys(("kg", "kgs", "kilo", "kilos", "kilogram", "kilograms"), "kg"),
    **dict.fromkeys(("lb", "lbs"), "lb"),
    **dict.fromkeys(("l", "litre", "litres", "liter", "liters"), "l"),
    **dict.fromkeys(("ml", "millilitre", "millilitres", "milliliter", "milliliters"), "ml"),
    **{unit: unit.upper() for unit in ("kb", "mb", "gb", "tb")},
    **dict.fromkeys(("%", "percent", "per cent", "pct"), "%"),
    **dict.fromkeys(("°c", "celsius"), "°C"),
    **dict.fromkeys(("°f", "fahrenheit"), "°F"),
    **dict.fromkeys(("€", "eur", "euro", "euros"), "EUR"),
    **dict.fromkeys(("$", "usd", "dollar", "dollars"), "USD"),
    **dict.fromkeys(("£", "gbp"), "GBP"),
    **dict.fromkeys(("chf", "franc", "francs"), "CHF"),
    **dict.fromkeys(("¥", "jpy", "yen"), "JPY"),
}
# Capitalised words that are not names wherever they stand (a short list on purpose: a
# name missed costs a check, a word wrongly kept costs a passing answer).
NAME_STOP_WORDS = frozenset(
    {"i", "i'm", "i'll", "i've", "i'd", "ok", "okay", "please", "thanks", "thank", "hello"}
    | {"hi", "dear", "yes", "no", "sorry", "note"}
)
_CODE_STOP_WORDS = frozenset({"AM", "PM", "OK", "ID"})

_MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sept", "sep"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ),
        start=1,
    )
    for name in names
}
# fmt: off
_SMALL_NUMBERS = {
    word: value
    for value, word in enumerate((
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen",
    ))
}
# fmt: on
_TENS = {
    word: 10 * i
    for i, word in enumerate(("twenty", "thirty", "forty", "fifty", "sixty", "seventy"), 2)
}
_TENS |= {"eighty": 80, "ninety": 90}

_MONTH = "(?P<mon>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\b\.?"
_WEEKDAY = r"(?:(?:mon|tues?|wed(?:nes)?|thu(?:rs)?|fri|sat(?:ur)?|sun)(?:day)?\b\.?,?\s+)?"
_ORDINAL = r"(?:st|nd|rd|th)?"
_DATE_PATTERNS = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"(?<![\w/-])(?P<y>\d{4})([-/])(?P<mo>\d{1,2})\2(?P<d>\d{1,2})(?![\d/-])",
        rf"(?<!\w){_WEEKDAY}(?P<d>\d{{1,2}}){_ORDINAL}\.?\s+(?:of\s+)?{_MONTH}"
        r"(?:,?\s+(?P<y>\d{4}))?(?![\w:])",
        rf"(?<!\w){_WEEKDAY}{_MONTH}\s+(?P<d>\d{{1,2}}){_ORDINAL}(?:,?\s+(?P<y>\d{{4}}))?"
        r"(?![\w:])",
        rf"(?<!\w){_MONTH}\s+(?P<y>\d{{4}})(?!\w)",
    )
)
_AMPM = r"(?:\s?(?P<ap>[ap])\.?m\b\.?)"
_TIME_PATTERNS = (
    re.compile(
        r"(?<![\d:.])(?<![A-SU-Za-su-z])(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)(?::(?P<s>[0-5]\d))?(?![\d:])"
        + _AMPM
        + "?",
        re.IGNORECASE,
    ),
    re.compile(r"(?<![\w:.])(?P<h>1[0-2]|0?[1-9])" + _AMPM, re.IGNORECASE),
)
_CURRENCY_PREFIX = r"(?:(?P<sym>[€$£¥])\s?|(?P<cur>EUR|USD|GBP|CHF|JPY)\s)?"
_NUMBER = re.compile(
    r"(?<![\w.])(?<![A-Za-z]-)"
    + _CURRENCY_PREFIX
    + r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])"
    r"|\d+,\d{2}(?![\d,])(?=\s?(?:[€$£¥]|(?:EUR|euros?)\b))"
    r"|(?<=[€$£¥])\d+,\d{2}(?![\d,])"
    r"|\d+(?:\.\d+)?)"
)
_NUMBER_WORD = re.compile(
    r"(?<![\w-])(?:(?P<tens>" + "|".join(_TENS) + r")[-\s](?P<ones>one|two|three|four|five|six"
    r"|seven|eight|nine)|(?P<word>" + "|".join([*_SMALL_NUMBERS, *_TENS, "hundred"]) + r"))\b",
    re.IGNORECASE,
)
# What may follow a number as its unit: joined ("3km"), hyphenated ("11-minute") or spaced.
_UNIT_AFTER = re.compile(r"(?:\s?-\s?|\s)?(?P<unit>per\s+cent|°\s?[CF]\b|[%€$£¥]|[A-Za-z]+\b)")
_ORDINAL_AFTER = re.compile(r"(?:st|nd|rd|th)\b", re.IGNORECASE)
_TOKEN = re.compile(r"(?<![\w-])[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*(?![\w-])")
_WORD = re.compile(r"(?<![\w'\u2019])[^\W\d_][\w'\u2019]*")
_QUOTES = tuple(
    re.compile(pattern)
    for pattern in (
        r'"(?P<q>[^"\n]{1,200})"',
        r"“(?P<q>[^”\n]{1,200})”",
        r"«\s?(?P<q>[^»\n]{1,200}?)\s?»",
        r"\u2018(?P<q>(?:[^\u2019\n]|\u2019(?=\w)){1,200})\u2019(?!\w)",
        r"(?<!\w)'(?P<q>(?:[^'\n]|'(?=\w)){1,200})'(?!\w)",
    )
)
_OPENERS = "\"'\u201c\u2018«([{*•-\u2013\u2014"


class FactsError(ValueError):
    """Stored facts that are not the documented objects."""


@dataclass(frozen=True)
class Fact:
    """One checkable fact: its kind, its normal form (``value``) and how the reference
    wrote it (``text``, shown to people and used to find a code's parts)."""

    kind: FactKind
    value: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value, "text": self.text}

    @classmethod
    def from_dict(cls, raw: Any, *, where: str) -> Fact:
        """A stored fact, checked: a task file is input like any other."""
        if not isinstance(raw, Mapping) or set(raw) != {"kind", "value", "text"}:
            raise FactsError(f"{where} must be an object with exactly kind, value and text")
        kind, value, text = raw["kind"], raw["value"], raw["text"]
        if kind not in FACT_KINDS:
            raise FactsError(f"{where}.kind must be one of {list(FACT_KINDS)}, got {kind!r}")
        for name, field in (("value", value), ("text", text)):
            if not isinstance(field, str) or not field.strip() or len(field) > _MAX_FIELD:
                raise FactsError(f"{where}.{name} must be a non-empty string of at most 500")
        fact = cls(kind, value, text)
        if kind == "number" and _number_parts(value) is None:
            raise FactsError(f"{where}.value {value!r} is not a number with an optional unit")
        if kind == "date" and _date_parts(value) is None:
            raise FactsError(f"{where}.value {value!r} is not a date (YYYY-MM-DD, --MM-DD)")
        return fact

    @property
    def group(self) -> str | None:
        """The kind hedging is counted by (see the module docstring), or None."""
        if self.kind in ("time", "date"):
            return self.kind
        if self.kind == "number":
            return f"number:{self.value.partition(' ')[2]}"
        if self.kind == "code":
            return f"code:{_shape(self.value)}"
        return None

    @property
    def hedge_key(self) -> str:
        """What makes two values of one kind distinct (a date: its month and day)."""
        if self.kind == "date":
            date = _date_parts(self.value)
            return f"{date[1]}-{date[2]}" if date else self.value
        if self.kind == "number":
            number = _number_parts(self.value)
            return str(number[0]) if number else self.value
        return self.value


@dataclass(frozen=True)
class FactsScore:
    """How much of the reference an answer states, and why it did not pass."""

    fraction: float
    passed: bool
    missing: tuple[Fact, ...] = ()
    hedged: tuple[str, ...] = ()


def extract_facts(text: str) -> list[Fact]:
    """The checkable facts of ``text``, in the order written, each once."""
    taken = bytearray(len(text))
    found: list[tuple[int, Fact]] = []
    for finder in (_quotes, _dates, _times, _numbers, _codes):
        for start, end, fact in finder(text):
            if not any(taken[start:end]):
                taken[start:end] = b"\x01" * (end - start)
                found.append((start, fact))
    codes = {start for start, fact in found if fact.kind == "code"}
    found.extend(_names(text, taken, codes))
    facts: list[Fact] = []
    seen: set[tuple[str, str]] = set()
    for _, fact in sorted(found, key=lambda item: item[0]):
        if (fact.kind, fact.value) not in seen:
            seen.add((fact.kind, fact.value))
            facts.append(fact)
    return facts


def score_facts(answer: str, facts: tuple[Fact, ...] | list[Fact]) -> FactsScore:
    """Which of ``facts`` ``answer`` states, with hedged kinds earning nothing."""
    if not facts:
        raise FactsError("the facts rule needs at least one fact")
    stated = extract_facts(answer)
    hedged = _hedged_groups(facts, stated)
    folded = _fold(answer)
    missing = [
        fact for fact in facts if fact.group in hedged or not _present(fact, stated, answer, folded)
    ]
    credited = len(facts) - len(missing)
    return FactsScore(
        fraction=credited / len(facts),
        passed=not missing,
        missing=tuple(missing),
        hedged=tuple(sorted(hedged)),
    )


# -- finders: (start, end, fact) of each match in the text ----------------------------------


def _quotes(text: str) -> Iterator[tuple[int, int, Fact]]:
    for pattern in _QUOTES:
        for match in pattern.finditer(text):
            value = _words_form(match.group("q"))
            if value:
                yield match.start(), match.end(), Fact("quote", value, match.group("q").strip())


def _dates(text: str) -> Iterator[tuple[int, int, Fact]]:
    for pattern in _DATE_PATTERNS:
        for match in pattern.finditer(text):
            groups = match.groupdict()
            month = _MONTHS.get((groups.get("mon") or "").lower()) or int(groups.get("mo") or 0)
            year = int(groups["y"]) if groups.get("y") else None
            day = int(groups["d"]) if groups.get("d") else None
            value = _date_value(year, month, day)
            if value is not None:
                yield match.start(), match.end(), Fact("date", value, match.group(0).strip())


def _times(text: str) -> Iterator[tuple[int, int, Fact]]:
    for pattern in _TIME_PATTERNS:
        for match in pattern.finditer(text):
            groups = match.groupdict()
            hour, minute = int(groups["h"]), int(groups.get("m") or 0)
            second = int(groups.get("s") or 0)
            ampm = (groups.get("ap") or "").lower()
            if ampm and 1 <= hour <= 12:
                hour = hour % 12 + (12 if ampm == "p" else 0)
            value = f"{hour:02d}:{minute:02d}" + (f":{second:02d}" if second else "")
            yield match.start(), match.end(), Fact("time", value, match.group(0).strip())


def _numbers(text: str) -> Iterator[tuple[int, int, Fact]]:
    for match in _NUMBER.finditer(text):
        literal = match.group("num")
        if "," in literal and not re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", literal):
            literal = literal.replace(",", ".")  # a decimal comma (money only, see _NUMBER)
        prefix = match.group("sym") or match.group("cur")
        number = Decimal(literal.replace(",", ""))
        found = _with_unit(text, match.start(), match.end(), number, prefix)
        if found is not None:
            end, fact = found
            yield match.start(), end, fact
    for match in _NUMBER_WORD.finditer(text):
        word = (match.group("word") or "").lower()
        value = _SMALL_NUMBERS.get(word, _TENS.get(word, 100 if word == "hundred" else 0))
        if match.group("tens"):
            value = _TENS[match.group("tens").lower()] + _SMALL_NUMBERS[match.group("ones").lower()]
        unit = _unit_at(text, match.end())
        if unit is not None:  # spelled numbers count only before a unit
            yield (
                match.start(),
                unit[0],
                _number_fact(Decimal(value), unit[1], text, match.start(), unit[0]),
            )


def _codes(text: str) -> Iterator[tuple[int, int, Fact]]:
    for match in _TOKEN.finditer(text):
        token = match.group(0)
        letters = any(c.isalpha() for c in token)
        digits = any(c.isdigit() for c in token)
        shouting = token.isalpha() and token.isupper() and len(token) >= 2
        if (letters and digits) or (shouting and token not in _CODE_STOP_WORDS):
            yield match.start(), match.end(), Fact("code", _code_value(token), token)


def _names(text: str, taken: bytearray, codes: set[int]) -> Iterator[tuple[int, Fact]]:
    """Runs of capitalised words (joined by one space or hyphen) outside other facts."""
    run: list[re.Match[str]] = []
    for match in _WORD.finditer(text):
        if _is_name_word(match, taken):
            if run and text[run[-1].end() : match.start()] not in (" ", "-"):
                yield from _name_of(text, run, codes)
                run = []
            run.append(match)
        elif run:
            yield from _name_of(text, run, codes)
            run = []
    if run:
        yield from _name_of(text, run, codes)


# -- helpers ---------------------------------------------------------------------------------


def _with_unit(
    text: str, start: int, end: int, value: Decimal, prefix: str | None
) -> tuple[int, Fact] | None:
    """The number at ``text[start:end]`` with the unit after it (or its currency prefix);
    None when letters stick to it that are no unit (``318A``: a code)."""
    unit = UNITS.get(prefix.lower()) if prefix else None
    after = _unit_at(text, end)
    if after is not None and unit is None:
        end, unit = after
    elif after is None and text[end : end + 1].isalpha():
        ordinal = _ORDINAL_AFTER.match(text, end)
        if ordinal is None:
            return None
        end = ordinal.end()
    return end, _number_fact(value, unit, text, start, end)


def _unit_at(text: str, end: int) -> tuple[int, str] | None:
    match = _UNIT_AFTER.match(text, end)
    if match is None:
        return None
    word = " ".join(match.group("unit").lower().replace("° ", "°").split())
    unit = UNITS.get(word)
    return (match.end(), unit) if unit is not None else None


def _number_fact(value: Decimal, unit: str | None, text: str, start: int, end: int) -> Fact:
    normal = format(value.normalize(), "f")
    return Fact("number", f"{normal} {unit}" if unit else normal, text[start:end].strip())


def _number_parts(value: str) -> tuple[Decimal, str] | None:
    number, _, unit = value.partition(" ")
    try:
        return Decimal(number).normalize(), unit
    except InvalidOperation:
        return None


def _date_value(year: int | None, month: int, day: int | None) -> str | None:
    if not 1 <= month <= 12:
        return None
    if day is not None and not 1 <= day <= calendar.monthrange(year or 2000, month)[1]:
        return None
    if day is None:
        return f"{year:04d}-{month:02d}" if year is not None else None
    return f"{year:04d}-{month:02d}-{day:02d}" if year is not None else f"--{month:02d}-{day:02d}"


def _date_parts(value: str) -> tuple[int | None, int, int | None] | None:
    match = re.fullmatch(r"(\d{4}|-)-(\d{2})(?:-(\d{2}))?", value)
    if match is None:
        return None
    year = None if match.group(1) == "-" else int(match.group(1))
    day = int(match.group(3)) if match.group(3) else None
    if (year is None and day is None) or _date_value(year, int(match.group(2)), day) is None:
        return None
    return year, int(match.group(2)), day


def _code_value(token: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", token).upper()


def _shape(code: str) -> str:
    """Runs of letters (A) and digits (9): ``LX318`` and ``D4`` are both ``A9``."""
    return re.sub(r"(.)\1+", r"\1", re.sub(r"\d", "9", re.sub(r"[A-Za-z]", "A", code)))


def _fold(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def _words_form(text: str) -> str:
    return " ".join(re.findall(r"\w+", _fold(text)))


def _is_name_word(match: re.Match[str], taken: bytearray) -> bool:
    word = match.group(0)
    return (
        len(word) >= 2
        and word[0].isupper()
        and any(c.islower() for c in word)
        and word.casefold().replace("\u2019", "'") not in NAME_STOP_WORDS
        and not any(taken[match.start() : match.end()])
    )


def _starts_sentence(text: str, start: int) -> bool:
    before = text[:start].rstrip(" \t" + _OPENERS)
    return not before or before[-1] in ".!?:…\n\r"


def _name_of(text: str, run: list[re.Match[str]], codes: set[int]) -> Iterator[tuple[int, Fact]]:
    if _starts_sentence(text, run[0].start()):
        run = run[1:]
    if not run:
        return
    after = len(text) - len(text[run[-1].end() :].lstrip(" "))
    if len(run) == 1 and after in codes and after > run[-1].end():
        return  # "Gate D4": the word labels the code
    written = re.sub(r"['\u2019]s$", "", text[run[0].start() : run[-1].end()])  # "Bob's": Bob
    yield run[0].start(), Fact("name", _words_form(written), written)


def _hedged_groups(facts: tuple[Fact, ...] | list[Fact], stated: list[Fact]) -> set[str]:
    def counts(found: tuple[Fact, ...] | list[Fact]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for fact in found:
            if fact.group is not None:
                out[fact.group].add(fact.hedge_key)
        return out

    want, got = counts(facts), counts(stated)
    return {group for group, values in want.items() if len(got.get(group, ())) > len(values)}


def _present(fact: Fact, stated: list[Fact], answer: str, folded: str) -> bool:
    if fact.kind in ("name", "quote"):
        words = fact.value.split()
        pattern = r"(?<!\w)" + r"\W+".join(map(re.escape, words)) + r"(?!\w)"
        return re.search(pattern, folded) is not None
    if fact.kind == "code":
        parts = re.findall(r"[A-Za-z]+|\d+", fact.text)
        pattern = r"(?<![A-Za-z0-9])" + r"[-\s_./]?".join(parts) + r"(?![A-Za-z0-9])"
        return re.search(pattern, answer, re.IGNORECASE) is not None
    same_kind = [s for s in stated if s.kind == fact.kind]
    if fact.kind == "time":
        return any(s.value == fact.value for s in same_kind)
    if fact.kind == "date":
        return any(_same_date(fact.value, s.value) for s in same_kind)
    want = _number_parts(fact.value)
    return any(_same_number(want, _number_parts(s.value)) for s in same_kind)


def _same_date(want: str, got: str) -> bool:
    w, g = _date_parts(want), _date_parts(got)
    if w is None or g is None or w[1] != g[1]:
        return False
    if w[2] is not None and g[2] != w[2]:
        return False
    return w[0] is None or g[0] is None or w[0] == g[0]


def _same_number(want: tuple[Decimal, str] | None, got: tuple[Decimal, str] | None) -> bool:
    if want is None or got is None or want[0] != got[0]:
        return False
    return not want[1] or want[1] == got[1]
