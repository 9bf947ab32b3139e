"""Inline SVG charts: they parse as XML, hold one mark per datum, and escape every label."""

from __future__ import annotations

import datetime as dt
import xml.etree.ElementTree as ET

import pytest

from services.dashboard.charts import (
    HEIGHT,
    Axis,
    Bar,
    Marker,
    Point,
    Series,
    bar_chart,
    line_chart,
    nice_ticks,
)

SVG = "{http://www.w3.org/2000/svg}"
PERCENT = Axis(ticks=(0, 0.5, 1), format=lambda v: f"{v * 100:.0f}%", low=0, high=1)


def _parse(markup: str) -> ET.Element:
    return ET.fromstring(str(markup))


def _x_axis(low: float, high: float) -> Axis:
    return Axis(ticks=(low, high), format=lambda v: f"{v:g}", low=low, high=high)


def test_a_line_chart_has_a_point_per_datum_and_a_line() -> None:
    points = [Point(x, y, f"p{x}") for x, y in [(0, 0.2), (1, 0.5), (2, 0.9)]]
    svg = _parse(
        line_chart(
            [Series("live", "live", points)], x_axis=_x_axis(0, 2), y_axis=PERCENT, title="Live"
        )
    )
    circles = svg.findall(f".//{SVG}circle")
    assert len(circles) == 3
    assert [c.find(f"{SVG}title").text for c in circles] == ["p0", "p1", "p2"]  # type: ignore[union-attr]
    # Higher values are drawn higher (smaller y), and the line joins the three points.
    ys = [float(c.get("cy", "0")) for c in circles]
    assert ys[0] > ys[1] > ys[2]
    polyline = svg.find(f".//{SVG}polyline")
    assert polyline is not None and len(polyline.get("points", "").split()) == 3


def test_error_bars_span_the_interval() -> None:
    point = Point(1, 0.5, "c1", low=0.25, high=0.75)
    svg = _parse(
        line_chart(
            [Series("cand", "candidate", [point], connect=False)],
            x_axis=_x_axis(0, 2),
            y_axis=PERCENT,
            title="Eval",
        )
    )
    bars = svg.findall(f".//{SVG}line[@class='ci']")
    assert len(bars) == 3  # the whisker and its two caps
    whisker = bars[0]
    top, bottom = float(whisker.get("y1", "0")), float(whisker.get("y2", "0"))
    centre = float(svg.find(f".//{SVG}circle").get("cy", "0"))  # type: ignore[union-attr]
    assert top < centre < bottom
    assert centre - top == pytest.approx(bottom - centre, abs=0.11)
    assert svg.find(f".//{SVG}polyline") is None


def test_markers_outside_the_x_range_are_left_out() -> None:
    markers = [Marker(1, "promote", "c1 promoted"), Marker(5, "rollback", "later")]
    svg = _parse(line_chart([], x_axis=_x_axis(0, 2), y_axis=PERCENT, title="t", markers=markers))
    drawn = svg.findall(f".//{SVG}line")
    kinds = [line.get("class") for line in drawn if "marker" in (line.get("class") or "")]
    assert kinds == ["marker marker-promote"]


def test_every_label_is_escaped() -> None:
    evil = '<script>alert(1)</script>"onload="x'
    svg = str(
        line_chart(
            [Series(evil, evil, [Point(0, 0.5, evil)])],
            x_axis=Axis(ticks=(0,), format=str, low=0, high=1, tick_labels=(evil,)),
            y_axis=PERCENT,
            title=evil,
            markers=[Marker(0.5, evil, evil)],
        )
    )
    assert "<script>" not in svg
    assert '"onload="' not in svg
    root = _parse(svg)  # still well-formed XML
    assert root.find(f"{SVG}title").text == evil  # type: ignore[union-attr]
    bars = str(bar_chart([Bar(evil, 1.0, evil)], y_axis=PERCENT, title=evil))
    assert "<script>" not in bars
    _parse(bars)


def test_bars_grow_from_the_baseline() -> None:
    axis = Axis(ticks=(0, 1, 2), format=str, low=0, high=2)
    svg = _parse(
        bar_chart([Bar("c1", 1.0, "one"), Bar("c2", 2.0, "two")], y_axis=axis, title="Cost")
    )
    rects = svg.findall(f".//{SVG}rect")
    assert len(rects) == 2
    heights = [float(r.get("height", "0")) for r in rects]
    assert heights[1] == pytest.approx(2 * heights[0], rel=0.01)
    bottoms = {round(float(r.get("y", "0")) + float(r.get("height", "0")), 1) for r in rects}
    assert len(bottoms) == 1 and bottoms.pop() < HEIGHT


def test_a_single_point_is_drawn_in_the_middle() -> None:
    svg = _parse(
        line_chart(
            [Series("s", "s", [Point(3, 0.5, "only")])],
            x_axis=_x_axis(3, 3),
            y_axis=PERCENT,
            title="one",
        )
    )
    assert len(svg.findall(f".//{SVG}circle")) == 1


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0, 1, [0, 0.25, 0.5, 0.75, 1.0]),
        (0, 3.8, [0, 1, 2, 3, 4]),
        (0, 17, [0, 5, 10, 15, 20]),
        (-2.5, 7, [-2.5, 0, 2.5, 5, 7.5]),
        (2, 2, [2]),
    ],
)
def test_nice_ticks(low: float, high: float, expected: list[float]) -> None:
    assert nice_ticks(low, high) == pytest.approx(expected)


def test_nice_ticks_refuses_an_inverted_range() -> None:
    with pytest.raises(ValueError, match="must not be below"):
        nice_ticks(2, 1)


def test_time_tick_labels_tell_every_tick_apart() -> None:
    from services.dashboard.pages import time_tick_labels

    def ticks(start: dt.datetime, step: dt.timedelta) -> list[dt.datetime]:
        return [start + step * i for i in range(5)]

    morning = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)
    assert time_tick_labels(ticks(morning, dt.timedelta(hours=1))) == [
        "10:00",
        "11:00",
        "12:00",
        "13:00",
        "14:00",
    ]
    assert time_tick_labels(ticks(morning, dt.timedelta(seconds=10)))[:2] == [
        "10:00:00",
        "10:00:10",
    ]
    # Two days in 12-hour steps: times of day alone would repeat (10:00, 22:00, 10:00, ...).
    assert time_tick_labels(ticks(morning, dt.timedelta(hours=12))) == [
        "12-02 10:00",
        "12-02 22:00",
        "12-03 10:00",
        "12-03 22:00",
        "12-04 10:00",
    ]
    assert time_tick_labels(ticks(morning, dt.timedelta(days=1))) == [
        "12-02",
        "12-03",
        "12-04",
        "12-05",
        "12-06",
    ]
    assert time_tick_labels(ticks(morning, dt.timedelta(days=20)))[-1] == "2027-02-20"


def test_failure_signatures_are_shown_without_the_separator() -> None:
    from services.dashboard.queries import signature_label

    assert signature_label("wrong_answer|") == "wrong_answer"
    assert signature_label("failed|add,mul") == "failed · tools: add, mul"
    assert signature_label("no separator") == "no separator"
    assert signature_label(None) is None
