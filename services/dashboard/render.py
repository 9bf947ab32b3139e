"""The Jinja2 environment of the dashboard, its filters and its static files.

Autoescaping is on for every template (and for strings), undefined variables fail loudly,
and the only ``Markup`` that reaches a page is the SVG that ``charts`` builds from escaped
text and :func:`code_spans` (escaped text with ``<code>`` around its backticked commands),
so user data (loop names, reasons, prompts, log lines) is always escaped.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from decimal import Decimal
from functools import cache, lru_cache
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

STATIC_TYPES = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
EMPTY = "—"


def pct(value: float | None, digits: int = 1) -> str:
    """0.734 → ``73.4%``; ``None`` (nothing measured) → an em dash."""
    return EMPTY if value is None else f"{value * 100:.{digits}f}%"


def interval(bounds: tuple[float, float] | None) -> str:
    """A confidence interval as ``[61.2%, 78.9%]``."""
    if bounds is None:
        return EMPTY
    low, high = bounds
    return f"[{low * 100:.1f}%, {high * 100:.1f}%]"


def usd(value: Decimal | float | None) -> str:
    """Dollars with cents; sub-cent amounts keep four decimals so they do not read as $0.00."""
    if value is None:
        return EMPTY
    amount = float(value)
    if amount != 0 and abs(amount) < 0.01:
        return f"${amount:,.4f}"
    return f"${amount:,.2f}"


def when(value: dt.datetime | None) -> str:
    """A timestamp in UTC to the minute (the ``<time>`` element carries the full value)."""
    if value is None:
        return EMPTY
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def iso(value: dt.datetime | None) -> str:
    return "" if value is None else value.astimezone(dt.UTC).isoformat()


def duration(seconds: float | None) -> str:
    """``45s``, ``3m 12s``, ``2h 05m``, ``3d 4h``."""
    if seconds is None:
        return EMPTY
    total = round(max(0.0, seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def short(value: str | None, length: int = 12) -> str:
    """The head of a long id (a sha256 checkpoint id)."""
    if not value:
        return EMPTY
    return value if len(value) <= length else value[:length] + "…"


def number(value: float | None, digits: int = 2) -> str:
    return EMPTY if value is None else f"{value:,.{digits}f}"


def size(value: int | None) -> str:
    """Bytes in binary units."""
    if value is None:
        return EMPTY
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def code_spans(value: str) -> Markup:
    """Text whose `backticked` parts are commands to copy: escaped, each such part in
    ``<code>`` (an unpaired backtick stays as it is)."""
    parts = str(escape(value)).split("`")
    if len(parts) % 2 == 0:  # unpaired: the last backtick is text
        parts[-2:] = ["`".join(parts[-2:])]
    html = "".join(f"<code>{part}</code>" if i % 2 else part for i, part in enumerate(parts))
    return Markup(html)  # every part was escaped above


def static_bytes(name: str) -> bytes:
    return resources.files("services.dashboard").joinpath("static", name).read_bytes()


@cache
def static_url(name: str) -> str:
    """The URL of a static file, versioned by its content so browsers never run stale JS."""
    if name not in STATIC_TYPES:
        raise KeyError(f"unknown static file {name!r}")
    digest = hashlib.sha256(static_bytes(name)).hexdigest()[:12]
    return f"/static/dashboard/{name}?v={digest}"


@lru_cache(maxsize=1)
def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("services.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        pct=pct,
        interval=interval,
        usd=usd,
        when=when,
        iso=iso,
        duration=duration,
        short=short,
        number=number,
        size=size,
        code_spans=code_spans,
    )
    env.globals["static_url"] = static_url
    return env


def render(template: str, **context: Any) -> str:
    """Render a page template with its context."""
    return environment().get_template(template).render(**context)
