"""The argparse types the commands and the benchmarks share.

Standard library only: a benchmark that runs where a train job runs (a GPU node's image,
with torch and no database packages) imports them without the CLI's settings.
"""

from __future__ import annotations

import argparse

__all__ = ["fraction", "positive_int"]


def positive_int(raw: str) -> int:
    """An argparse type: a whole number of at least 1, refused with a one-line reason."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def fraction(raw: str) -> float:
    """An argparse type: a number in [0, 1], refused with a one-line reason."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{raw} must be in [0, 1]")
    return value
