"""argparse value types shared by the command lines; a bad value's message says what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = ["fraction", "positive_float", "positive_int"]

T = TypeVar("T", int, float)


def _checked(cast: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    def parse(text: str) -> T:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in its own messages
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a whole number >= 1")
positive_float = _checked(float, lambda v: v > 0, "a positive number")
fraction = _checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
