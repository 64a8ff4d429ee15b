"""The gate's rules on numbers: the floor, and the one-sided two-proportion test against a baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_pd.deploy.evals import Baseline, UsageError, check_baseline, check_floor, load_baseline


def _baseline(correct: int, n: int = 200) -> Baseline:
    return Baseline(Path("old.json"), correct, n, "m", "fp")


@pytest.mark.parametrize(("correct", "passed"), [(100, True), (101, True), (99, False)])
def test_floor_on_both_sides(correct: int, passed: bool) -> None:
    rule = check_floor(correct, 200, 0.5)
    assert rule.passed is passed
    assert f"({correct}/200)" in rule.message and "--min-accuracy 0.5" in rule.message
    assert ("below" in rule.message) is not passed


def test_baseline_passes_a_one_point_drop_on_200_questions() -> None:
    # 80 % → 79 %: well inside the noise of 200 questions.
    rule = check_baseline(158, 200, _baseline(160), questions_fingerprint="fp")
    assert rule.passed, rule.message
    assert rule.numbers["drop"] == pytest.approx(0.01)
    assert "note" not in rule.message


@pytest.mark.parametrize("max_drop", [0.0, 0.01, 0.02])
def test_baseline_fails_a_ten_point_drop_on_200_questions(max_drop: float) -> None:
    rule = check_baseline(140, 200, _baseline(160), max_drop=max_drop)
    assert not rule.passed
    assert rule.numbers["p_value"] < 0.05 and rule.numbers["z"] > rule.numbers["z_critical"]
    for text in ("0.7000 (140/200)", "0.8000 (160/200", "drop +0.1000 exceeds", f"--max-drop {max_drop:g}", "0.95"):
        assert text in rule.message


def test_a_generous_margin_or_lower_confidence_changes_the_verdict() -> None:
    assert check_baseline(140, 200, _baseline(160), max_drop=0.06).passed
    # z = (0.10 - 0.04) / 0.0430 ≈ 1.39: fails at 90 % (critical 1.28), passes at 95 % (1.64).
    assert not check_baseline(140, 200, _baseline(160), max_drop=0.04, confidence=0.90).passed
    assert check_baseline(140, 200, _baseline(160), max_drop=0.04, confidence=0.95).passed


def test_an_improvement_passes() -> None:
    assert check_baseline(190, 200, _baseline(160), max_drop=0.0).passed


def test_no_variance_falls_back_to_the_observed_drop() -> None:
    assert not check_baseline(0, 200, _baseline(200, 200), max_drop=0.5).passed
    assert check_baseline(200, 200, _baseline(200, 200), max_drop=0.0).passed


def test_different_questions_are_noted() -> None:
    rule = check_baseline(158, 200, _baseline(160), questions_fingerprint="other")
    assert "different set of questions" in rule.message and rule.numbers["same_questions"] is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_drop": 1.5}, "--max-drop must be in"), ({"confidence": 1.0}, "--confidence must be in")],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_baseline(1, 2, _baseline(1, 2), **kwargs)


def test_load_baseline(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"metrics": {"correct": 7, "n": 10}, "model": "m", "config": {}}))
    assert load_baseline(good).accuracy == 0.7
    for name, text, message in [
        ("absent.json", None, "Cannot read the --baseline report"),
        ("notjson.json", "{", "is not JSON"),
        ("other.json", json.dumps({"accuracy": 0.7}), "not a gsm8k report of this tool"),
        ("zero.json", json.dumps({"metrics": {"correct": 0, "n": 0}}), "not a gsm8k report of this tool"),
    ]:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(UsageError, match=message):
            load_baseline(path)
