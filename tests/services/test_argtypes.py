"""The argparse types the commands and benchmarks share: what they accept, what they refuse."""

from __future__ import annotations

import argparse

import pytest

from services.argtypes import fraction, positive_int


@pytest.mark.parametrize(("raw", "value"), [("0", 0.0), ("0.5", 0.5), ("1", 1.0), ("1e-1", 0.1)])
def test_fraction_accepts_numbers_in_the_unit_interval(raw: str, value: float) -> None:
    assert fraction(raw) == value


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("-0.1", "must be in"),
        ("1.5", "must be in"),
        ("half", "not a number"),
        ("nan", "must be in"),
    ],
)
def test_fraction_refuses_anything_else_with_a_reason(raw: str, reason: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=reason):
        fraction(raw)


def test_positive_int_refuses_zero_and_words() -> None:
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number"):
        positive_int("two")
