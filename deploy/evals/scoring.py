"""Scoring in SGLang's convention (sglang 0.5.23, `sglang.test.simple_eval_mixed_prefix_gsm8k`).

The answer is the last match of `-?\\d+\\.?\\d*` once commas are removed, read as a Python literal, so
`18.0` equals `18`, `$1,000` is `1000` and `5-3` ends in `-3`. Strings Python refuses as literals
(`007`) are invalid, as in SGLang. A value equal to `INVALID` means "no number".
"""

from __future__ import annotations

import ast
import re

__all__ = ["INVALID", "extract_answer", "is_correct"]

# SGLang's sentinel; kept so that reports compare with SGLang's own dumps.
INVALID = -9999999

_NUMBER = re.compile(r"-?\d+\.?\d*")


def extract_answer(text: str) -> int | float:
    """The last number in `text` (commas removed), or INVALID."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        value = ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID
    # The pattern only admits int and float literals; anything else would be a bug here.
    return value if isinstance(value, int | float) else INVALID


def is_correct(extracted: int | float, label: int | float) -> bool:
    return extracted != INVALID and extracted == label
