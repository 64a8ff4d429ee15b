"""The three scores: the gate's equals SGLang's `run_eval` (0.5.23 `get_answer_value`) on tricky outputs,
lm-eval's strict-match and sglang's last_explicit read `#### N`, and labels compare as exact decimals."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from decimal import Decimal
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals.scoring import last_explicit, last_number, same_number, strict_match

SGLANG_INVALID = -9999999

# (model output, the number SGLang extracts as a string, or None for SGLang's INVALID)
TRICKY: list[tuple[str, str | None]] = [
    ("The answer is 18.", "18."),  # "18." is a float literal: still equal to 18
    ("#### 18", "18"),
    ("She pays $1,000 in total.", "1000"),  # comma and dollar sign
    ("1,234,567 apples", "1234567"),
    ("The total is 18.0", "18.0"),
    ("It costs $18.50", "18.50"),
    ("The change is -5 degrees", "-5"),
    ("5-3 = 2 so the answer is 2", "2"),
    ("The answer is 2, not 5-3", "-3"),  # `5-3` reads as 5 and -3: the last number wins
    ("72 clips in April, 48 in May. #### 72\n\nQuestion", "72"),
    ("First 12, then 15, finally 27 dollars", "27"),
    ("I cannot tell.", None),
    ("", None),
    ("The answer is 007", None),  # Python refuses leading zeros, and so does SGLang
    ("The answer is 007.5", "007.5"),  # ... but not in a float literal
    ("00 apples", "00"),
    ("about 3/4 of them", "4"),
    ("1e5 grains", "5"),
    ("-0", "-0"),
    ("Total: 1,000.25 dollars", "1000.25"),
    ("the answer is 42\n", "42"),
    ("x" * 10 + "9" * 5000, None),  # more digits than int() accepts: invalid, not a crash
    ("9" * 400 + ". dollars", "9" * 400 + "."),  # SGLang reads inf here; kept exact as a string
]


@pytest.mark.parametrize(("output", "expected"), TRICKY)
def test_last_number_table(output: str, expected: str | None) -> None:
    assert last_number(output) == expected


@pytest.fixture(scope="module")
def sglang_get_answer_value() -> Callable[[str], Any]:
    """SGLang's own function, compiled from its installed source alone: importing the module would pull
    in seconds of sglang imports."""
    try:
        source = metadata.distribution("sglang").locate_file("sglang/test/simple_eval_mixed_prefix_gsm8k.py")
        tree = ast.parse(Path(str(source)).read_text())
    except (metadata.PackageNotFoundError, OSError):
        pytest.skip("sglang is not installed (the `validate` extra)")
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_answer_value"]
    keep += [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "INVALID"]
    namespace: dict[str, Any] = {"ast": ast, "re": re}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(source), "exec"), namespace)
    return namespace["get_answer_value"]


@pytest.mark.sglang
@pytest.mark.parametrize(("output", "expected"), TRICKY)
def test_last_number_matches_sglang(
    output: str, expected: str | None, sglang_get_answer_value: Callable[[str], Any]
) -> None:
    theirs = sglang_get_answer_value(output)
    ours = last_number(output)
    if theirs == SGLANG_INVALID:
        assert ours is None
    else:
        # SGLang's float is the nearest double to our exact string (inf past 308 digits).
        assert ours is not None and float(Decimal(ours)) == theirs


@pytest.mark.parametrize(
    ("extracted", "label", "correct"),
    [
        ("18.0", "18", True),
        ("18.", "18", True),
        ("18", "18", True),
        ("-0", "0", True),
        ("0018.50", "18.5", True),
        ("18.5", "18", False),
        ("-18", "18", False),
        (None, "18", False),
        ("9" * 400 + ".", "18", False),  # no inf, no overflow: just a different number
        ("1" + "0" * 30, "1" + "0" * 30, True),  # beyond float precision, still exact
        ("1" + "0" * 30, "1" + "0" * 29 + "1", False),
        ("not a number", "18", False),
    ],
)
def test_same_number_is_exact(extracted: str | None, label: str, correct: bool) -> None:
    assert same_number(extracted, label) is correct


@pytest.mark.parametrize(
    ("output", "run_eval", "strict", "explicit"),
    [
        # The case: a number after `#### N` wins only under the last-number rule.
        ("So 42 dollars.\n#### 42 dollars (4,200 cents)", "4200", "42", "42"),
        ("#### 1,000.", "1000.", "1000", "1000"),  # lm-eval drops commas and a final period
        ("#### $18", "18", None, "18"),  # strict needs the number right after '#### '
        ("no marker, 7 then 8", "8", None, "8"),  # last_explicit falls back to the last number
        ("#### 3\nthen #### 5 and 9", "9", "3", "5"),  # strict takes the first marker, explicit the last
        ("", None, None, None),
    ],
)
def test_three_scores(output: str, run_eval: str | None, strict: str | None, explicit: str | None) -> None:
    assert last_number(output) == run_eval
    assert strict_match(output) == strict
    assert last_explicit(output) == explicit
