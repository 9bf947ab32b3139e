"""Inline SVG charts, rendered on the server: no JavaScript, no vendored library.

Each function returns ``Markup`` (safe to drop into a Jinja2 template) built only from
numbers it formats itself and text it escapes, so user data in a label (a loop name, a
reason) cannot break out of the SVG. Colours come from CSS classes in ``dashboard.css``;
the charts use SVG presentation attributes only, never ``style=``, so the pages' Content
Security Policy can forbid inline styles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

WIDTH = 720
HEIGHT = 240
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 16, 18, 30


@dataclass(frozen=True)
class Point:
    """One observation; ``low``/``high`` draw an error bar (a confidence interval)."""

    x: float
    y: float
    label: str
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class Series:
    """A named run of points; ``css`` picks its colour, ``connect`` draws the line."""

    name: str
    css: str
    points: Sequence[Point]
    connect: bool = True


@dataclass(frozen=True)
class Marker:
    """A vertical line at ``x``: a promotion, a rollback, a drift."""

    x: float
    kind: str
    label: str


@dataclass(frozen=True)
class Bar:
    """One bar of a bar chart."""

    label: str
    value: float
    title: str


@dataclass(frozen=True)
class Axis:
    """Tick positions and how to write a value on this axis."""

    ticks: Sequence[float]
    format: Callable[[float], str]
    low: float
    high: float
    tick_labels: Sequence[str] = field(default_factory=tuple)

    def label(self, index: int, value: float) -> str:
        if index < len(self.tick_labels):
            return self.tick_labels[index]
        return self.format(value)


def _num(value: float) -> str:
    return f"{value:.1f}"


class _Frame:
    """Maps data coordinates to the SVG viewport."""

    def __init__(self, x: Axis, y: Axis) -> None:
        self.x_axis, self.y_axis = x, y
        self.plot_w = WIDTH - _LEFT - _RIGHT
        self.plot_h = HEIGHT - _TOP - _BOTTOM

    def x(self, value: float) -> float:
        span = self.x_axis.high - self.x_axis.low
        ratio = 0.5 if span <= 0 else (value - self.x_axis.low) / span
        return _LEFT + ratio * self.plot_w

    def y(self, value: float) -> float:
        span = self.y_axis.high - self.y_axis.low
        ratio = 0.5 if span <= 0 else (value - self.y_axis.low) / span
        return _TOP + (1 - min(1.0, max(0.0, ratio))) * self.plot_h


def _open_svg(title: str, css: str) -> list[str]:
    return [
        f'<svg class="chart {escape(css)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]


def _axes(frame: _Frame) -> list[str]:
    parts = ['<g class="axes">']
    right = WIDTH - _RIGHT
    for index, tick in enumerate(frame.y_axis.ticks):
        y = _num(frame.y(tick))
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{right}" y1="{y}" y2="{y}"/>')
        parts.append(
            f'<text class="tick y-tick" x="{_LEFT - 6}" y="{y}" text-anchor="end" '
            f'dominant-baseline="middle">{escape(frame.y_axis.label(index, tick))}</text>'
        )
    base, tick_end = _num(HEIGHT - _BOTTOM), _num(HEIGHT - _BOTTOM + 4)
    for index, tick in enumerate(frame.x_axis.ticks):
        x = _num(frame.x(tick))
        parts.append(f'<line class="tick-mark" x1="{x}" x2="{x}" y1="{base}" y2="{tick_end}"/>')
        parts.append(
            f'<text class="tick x-tick" x="{x}" y="{HEIGHT - 8}" text-anchor="middle">'
            f"{escape(frame.x_axis.label(index, tick))}</text>"
        )
    parts.append(f'<line class="axis" x1="{_LEFT}" x2="{right}" y1="{base}" y2="{base}"/>')
    parts.append("</g>")
    return parts


def _markers(frame: _Frame, markers: Sequence[Marker]) -> list[str]:
    parts = ['<g class="markers">']
    for marker in markers:
        if not frame.x_axis.low <= marker.x <= frame.x_axis.high:
            continue
        x = _num(frame.x(marker.x))
        parts.append(
            f'<line class="marker marker-{escape(marker.kind)}" x1="{x}" x2="{x}" '
            f'y1="{_TOP}" y2="{HEIGHT - _BOTTOM}"><title>{escape(marker.label)}</title></line>'
        )
    parts.append("</g>")
    return parts


def _series(frame: _Frame, series: Series) -> list[str]:
    parts = [f'<g class="series {escape(series.css)}" data-series="{escape(series.name)}">']
    coordinates = [(frame.x(p.x), frame.y(p.y)) for p in series.points]
    if series.connect and len(coordinates) > 1:
        path = " ".join(f"{_num(x)},{_num(y)}" for x, y in coordinates)
        parts.append(f'<polyline class="line" fill="none" points="{path}"/>')
    for point, (x, y) in zip(series.points, coordinates, strict=True):
        if point.low is not None and point.high is not None:
            top, bottom = _num(frame.y(point.high)), _num(frame.y(point.low))
            parts.append(
                f'<line class="ci" x1="{_num(x)}" x2="{_num(x)}" y1="{top}" y2="{bottom}"/>'
            )
            for end in (top, bottom):
                parts.append(
                    f'<line class="ci" x1="{_num(x - 4)}" x2="{_num(x + 4)}" '
                    f'y1="{end}" y2="{end}"/>'
                )
        parts.append(
            f'<circle class="point" cx="{_num(x)}" cy="{_num(y)}" r="3.5">'
            f"<title>{escape(point.label)}</title></circle>"
        )
    parts.append("</g>")
    return parts


def line_chart(
    series: Sequence[Series],
    *,
    x_axis: Axis,
    y_axis: Axis,
    title: str,
    markers: Sequence[Marker] = (),
    css: str = "line-chart",
) -> Markup:
    """Points (with optional error bars) joined by lines, with vertical event markers."""
    frame = _Frame(x_axis, y_axis)
    parts = _open_svg(title, css)
    parts += _axes(frame)
    parts += _markers(frame, markers)
    for one in series:
        parts += _series(frame, one)
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(bars: Sequence[Bar], *, y_axis: Axis, title: str, css: str = "bar-chart") -> Markup:
    """One bar per item, labelled underneath; ``y_axis.low`` is the baseline."""
    slots = max(1, len(bars))
    x_axis = Axis(ticks=(), format=str, low=0, high=slots)
    frame = _Frame(x_axis, y_axis)
    parts = _open_svg(title, css)
    parts += _axes(frame)
    slot_width = frame.plot_w / slots
    bar_width = max(2.0, min(48.0, slot_width * 0.6))
    baseline = frame.y(max(y_axis.low, 0.0))
    parts.append('<g class="bars">')
    for index, bar in enumerate(bars):
        centre = _LEFT + slot_width * (index + 0.5)
        top = frame.y(bar.value)
        y, height = min(top, baseline), abs(baseline - top)
        parts.append(
            f'<rect class="bar{" negative" if bar.value < 0 else ""}" '
            f'x="{_num(centre - bar_width / 2)}" y="{_num(y)}" width="{_num(bar_width)}" '
            f'height="{_num(max(height, 0.5))}"><title>{escape(bar.title)}</title></rect>'
        )
        parts.append(
            f'<text class="tick x-tick" x="{_num(centre)}" y="{HEIGHT - 8}" '
            f'text-anchor="middle">{escape(bar.label)}</text>'
        )
    parts.append("</g></svg>")
    return Markup("".join(parts))


def nice_ticks(low: float, high: float, *, count: int = 5) -> list[float]:
    """About ``count`` round ticks covering [low, high]: 1, 2, 2.5 or 5 times a power of 10."""
    if high < low:
        raise ValueError(f"high ({high}) must not be below low ({low})")
    if high == low:
        return [low]
    raw_step = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw_step)
    first = math.floor(low / step + 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks
