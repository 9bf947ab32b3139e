"""Template filters, autoescaping and versioned static files."""

from __future__ import annotations

import datetime as dt
import hashlib
from decimal import Decimal

import pytest
from jinja2 import UndefinedError

from services.dashboard.render import (
    code_spans,
    duration,
    environment,
    interval,
    pct,
    short,
    size,
    static_bytes,
    static_url,
    usd,
    when,
)


def test_percentages() -> None:
    assert pct(0.7345) == "73.5%"
    assert pct(1.0, 0) == "100%"
    assert pct(None) == "—"
    assert interval((0.25534, 0.36621)) == "[25.5%, 36.6%]"


def test_dollars_keep_sub_cent_amounts_visible() -> None:
    assert usd(Decimal("1234.5")) == "$1,234.50"
    assert usd(0.0042) == "$0.0042"
    assert usd(0) == "$0.00"
    assert usd(None) == "—"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (45.4, "45s"),
        (192, "3m 12s"),
        (7500, "2h 05m"),
        (3 * 86400 + 4 * 3600, "3d 4h"),
        (None, "—"),
    ],
)
def test_durations(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text


def test_times_are_shown_in_utc() -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    assert when(dt.datetime(2026, 11, 29, 17, 5, tzinfo=paris)) == "2026-11-29 16:05 UTC"
    assert when(None) == "—"


def test_ids_and_sizes() -> None:
    assert short("a" * 64) == "a" * 12 + "…"
    assert short("abc") == "abc"
    assert size(512) == "512 B"
    assert size(12 * 1024 * 1024) == "12.0 MiB"
    assert size(5 * 1024**4) == "5120.0 GiB"


def test_templates_escape_user_data() -> None:
    template = environment().from_string("<p title='{{ v }}'>{{ v }}</p>")
    html = template.render(v="<script>alert('x')</script>")
    assert "<script>" not in html
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in html


def test_an_undefined_variable_fails_loudly() -> None:
    with pytest.raises(UndefinedError):
        environment().from_string("{{ missing.attr }}").render()


def test_static_urls_are_versioned_by_content() -> None:
    digest = hashlib.sha256(static_bytes("dashboard.js")).hexdigest()[:12]
    assert static_url("dashboard.js") == f"/static/dashboard/dashboard.js?v={digest}"
    with pytest.raises(KeyError, match="unknown static file"):
        static_url("../settings.py")


def test_code_spans_escape_the_text_and_mark_the_commands() -> None:
    assert str(code_spans("run `ratchet loop start <x>` & wait")) == (
        "run <code>ratchet loop start &lt;x&gt;</code> &amp; wait"
    )
    assert str(code_spans("an unpaired ` backtick <b>")) == "an unpaired ` backtick &lt;b&gt;"
    assert str(code_spans("`a` and `b")) == "<code>a</code> and `b"
