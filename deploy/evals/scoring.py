"""Three ways to read the answer out of a gsm8k completion, and exact comparison with the label.

- `last_number` is the gate's score: SGLang's `run_eval` GSM8K convention (sglang 0.5.23,
  `sglang.test.simple_eval_mixed_prefix_gsm8k.get_answer_value`): the last match of `-?\\d+\\.?\\d*`
  once commas are removed, refused where Python refuses it as a literal (`007`, or an integer longer
  than Python's 4300-digit limit), so the gate scores the way SGLang's own CI does.
- `strict_match` is lm-evaluation-harness's `strict-match` filter of its `gsm8k` task (version 3):
  the first `#### (-?[0-9.,]+)`, then its `regexes_to_ignore` (`,`, `$`, everything up to `#### `,
  a final `.`), compared as a string with the label treated the same way.
- `last_explicit` is sglang `run_eval`'s `gsm8k_answer_mode="last_explicit"`: the number of the
  last `#### N` in the output, else the last number.

Extracted answers stay strings; `same_number` compares them with the label as exact decimals, so
no output (a 400-digit number, `1e999`) can turn into an `inf` or lose digits.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["last_explicit", "last_number", "same_number", "strict_match", "strict_normalize"]

_NUMBER = re.compile(r"-?\d+\.?\d*")
# Python's default limit on int() of a decimal string (sys.int_info.default_max_str_digits): SGLang's
# `ast.literal_eval` refuses longer integers, so they are invalid here too.
_MAX_INT_DIGITS = 4300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_STRICT_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))
_EXPLICIT = re.compile(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


def _python_literal(token: str) -> str | None:
    """`token` (a match of _NUMBER) if `ast.literal_eval` would read it as a number, else None."""
    digits = token.lstrip("-")
    if "." not in digits:
        # Python refuses leading zeros in a non-zero integer literal (`007`), and overlong integers.
        if len(digits) > 1 and digits[0] == "0" and digits.strip("0"):
            return None
        if len(digits) > _MAX_INT_DIGITS:
            return None
    return token


def last_number(text: str) -> str | None:
    """The last number in `text` with commas removed (SGLang's `run_eval`), or None."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return _python_literal(numbers[-1]) if numbers else None


def strict_normalize(text: str) -> str:
    """lm-eval's `regexes_to_ignore` and `ignore_case` for its gsm8k task, applied to a prediction or a label."""
    for pattern in _STRICT_IGNORE:
        text = pattern.sub("", text)
    return text.strip().lower()


def strict_match(text: str) -> str | None:
    """lm-eval's strict-match: the first `#### N` of the output, normalised; None when there is none."""
    match = _STRICT.search(text)
    return strict_normalize(match.group(1)) if match else None


def last_explicit(text: str) -> str | None:
    """The number after the last `####` of the output, else the last number (sglang's `last_explicit`)."""
    matches = _EXPLICIT.findall(text)
    if matches:
        return _python_literal(matches[-1].replace(",", "")) or None
    return last_number(text)


def _decimal(value: str) -> Decimal | None:
    try:
        number = Decimal(value)
    except (InvalidOperation, ValueError):
        return None
    return number if number.is_finite() else None


def same_number(extracted: str | None, label: str) -> bool:
    """True when `extracted` and `label` are the same decimal number (`18.0` is `18`, `18.5` is not)."""
    if extracted is None:
        return False
    a, b = _decimal(extracted), _decimal(label)
    return a is not None and b is not None and a == b
