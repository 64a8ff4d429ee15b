"""Scoring equals SGLang's (0.5.23 `simple_eval_mixed_prefix_gsm8k.get_answer_value`) on tricky outputs."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals.scoring import INVALID, extract_answer, is_correct

# (model output, the value SGLang extracts)
TRICKY: list[tuple[str, int | float]] = [
    ("The answer is 18.", 18.0),  # "18." is a float literal: still equal to 18
    ("#### 18", 18),
    ("She pays $1,000 in total.", 1000),  # comma and dollar sign
    ("1,234,567 apples", 1234567),
    ("The total is 18.0", 18.0),
    ("It costs $18.50", 18.5),
    ("The change is -5 degrees", -5),
    ("5-3 = 2 so the answer is 2", 2),
    ("The answer is 2, not 5-3", -3),  # `5-3` reads as 5 and -3: the last number wins
    ("72 clips in April, 48 in May. #### 72\n\nQuestion", 72),
    ("First 12, then 15, finally 27 dollars", 27),
    ("I cannot tell.", INVALID),
    ("", INVALID),
    ("The answer is 007", INVALID),  # Python refuses leading zeros, and so does SGLang
    ("00 apples", 0),
    ("about 3/4 of them", 4),
    ("1e5 grains", 5),
    ("-0", 0),
    ("Total: 1,000.25 dollars", 1000.25),
    ("the answer is 42\n", 42),
    ("x" * 10 + "9" * 5000, INVALID),  # more digits than int() accepts: invalid, not a crash
]


@pytest.mark.parametrize(("output", "expected"), TRICKY)
def test_extract_answer_table(output: str, expected: int | float) -> None:
    got = extract_answer(output)
    assert got == expected
    assert type(got) is type(expected)


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
def test_extract_answer_matches_sglang(
    output: str, expected: int | float, sglang_get_answer_value: Callable[[str], Any]
) -> None:
    theirs = sglang_get_answer_value(output)
    assert extract_answer(output) == theirs
    assert type(extract_answer(output)) is type(theirs)


@pytest.mark.parametrize(
    ("output", "label", "correct"),
    [("18.0", 18, True), ("18", 18, True), ("18.5", 18, False), ("-18", 18, False), ("none", INVALID, False)],
)
def test_is_correct(output: str, label: int | float, correct: bool) -> None:
    assert is_correct(extract_answer(output), label) is correct
