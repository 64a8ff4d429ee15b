"""The gate's rules on numbers: the paired intervals, the paired non-inferiority rule, the floor, and
which baseline reports are refused (each with its reason)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals import (
    SCHEMA,
    Baseline,
    UsageError,
    check_compatible,
    check_floor,
    check_paired,
    load_baseline,
    newcombe_interval,
    paired_power,
    questions_fingerprint,
    tango_interval,
)

Z95 = 1.959964  # two-sided 95 %


def _score_by_numeric_mle(delta: float, b10: int, b01: int, n: int) -> float:
    """Tango's statistic with the restricted MLE of p01 found by maximising the likelihood numerically
    (golden-section search), independently of the closed form the gate uses."""
    rest = n - b10 - b01

    def loglik(q: float) -> float:
        p10, p_rest = q + delta, 1.0 - 2.0 * q - delta
        return b10 * math.log(p10) + b01 * math.log(q) + rest * math.log(p_rest)

    lo, hi = max(0.0, -delta) + 1e-12, (1.0 - delta) / 2.0 - 1e-12
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if loglik(a) < loglik(b):
            lo = a
        else:
            hi = b
    q = (lo + hi) / 2
    return (b10 - b01 - n * delta) / math.sqrt(n * (2 * q + delta * (1 - delta)))


@pytest.mark.parametrize(("b10", "b01", "n"), [(1, 7, 21), (13, 13, 1314), (53, 13, 1314), (4, 1, 200)])
def test_tango_limits_solve_the_score_equation(b10: int, b01: int, n: int) -> None:
    lower, upper = tango_interval(b10, b01, n, Z95)
    assert lower < (b10 - b01) / n < upper
    assert _score_by_numeric_mle(lower, b10, b01, n) == pytest.approx(Z95, abs=1e-4)
    assert _score_by_numeric_mle(upper, b10, b01, n) == pytest.approx(-Z95, abs=1e-4)


def test_tango_covers_the_true_drop_at_its_level() -> None:
    # One-sided 95 % upper bound, 95 % model with 1 % churn each way and a true 1-point drop, n = 300.
    rng = random.Random(3)
    n, p10, p01 = 300, 0.02, 0.01
    covered = 0
    for _ in range(2000):
        draws = [rng.random() for _ in range(n)]
        b10 = sum(d < p10 for d in draws)
        b01 = sum(p10 <= d < p10 + p01 for d in draws)
        covered += tango_interval(b10, b01, n, 1.645)[1] >= p10 - p01
    assert 0.93 <= covered / 2000 <= 0.985


def test_newcombe_is_close_to_tango_and_both_contain_the_estimate() -> None:
    # With enough discordant questions (Newcombe's interval collapses when there are almost none).
    rng = random.Random(7)
    for _ in range(200):
        n = rng.choice([200, 1314])
        b10, b01 = rng.randint(5, n // 10), rng.randint(5, n // 10)
        both = rng.randint(0, n - b10 - b01)
        t, w = tango_interval(b10, b01, n, 1.645), newcombe_interval(b10, b01, n, 1.645, both=both)
        estimate = (b10 - b01) / n
        assert t[0] <= estimate <= t[1] and w[0] <= estimate <= w[1]
        assert abs(t[1] - w[1]) < 0.02


def test_no_discordant_question_gives_the_closed_form_bound() -> None:
    # b10 = b01 = 0: the score bound solves n d / (1 - d) = z^2, i.e. d = z^2 / (n + z^2).
    for n in (200, 1314):
        assert tango_interval(0, 0, n, 1.645)[1] == pytest.approx(1.645**2 / (n + 1.645**2), rel=1e-6)


def test_interval_edges_stay_in_range() -> None:
    assert tango_interval(10, 0, 10, 1.645)[1] == pytest.approx(1.0)
    assert tango_interval(0, 10, 10, 1.645)[0] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="b10 \\+ b01 <= n"):
        tango_interval(6, 6, 10, 1.645)


def _baseline(outcomes: dict[int, bool], **overrides: Any) -> Baseline:
    fields: dict[str, Any] = {
        "path": Path("base.json"),
        "model": "m",
        "api": "completions",
        "num_shots": 5,
        "max_tokens": 512,
        "data_sha256": "sha",
        "questions_fingerprint": "fp",
        "outcomes": outcomes,
    }
    return Baseline(**{**fields, **overrides})


def _pair(n: int, lost: int, gained: int, wrong_in_both: int = 0) -> tuple[dict[int, bool], Baseline]:
    """Outcomes of a run against a baseline: `lost` questions right before and wrong now, `gained` the reverse."""
    base = {i: True for i in range(n)}
    now = dict(base)
    for i in range(lost):
        now[i] = False
    for i in range(lost, lost + gained):
        base[i] = False
    for i in range(lost + gained, lost + gained + wrong_in_both):
        base[i] = now[i] = False
    return now, _baseline(base)


def test_paired_rule_passes_an_unchanged_model_on_1314_questions() -> None:
    now, base = _pair(1314, lost=13, gained=13, wrong_in_both=60)
    rule = check_paired(now, base)
    assert rule.passed and rule.rule == "baseline_paired"
    numbers = rule.numbers
    assert (numbers["n"], numbers["b10"], numbers["b01"]) == (1314, 13, 13)
    assert numbers["drop"] == 0 and numbers["drop_upper"] < 0.01
    for text in ("paired on 1314 questions", "lost 13, gained 13", "drop +0.0000", "(tango) below --max-drop 0.02"):
        assert text in rule.message
    # The power it had at this n is printed: a 3-point drop would have been caught almost surely.
    assert "power at this n: 3-point drop" in rule.message and numbers["power"]["0.03"] > 0.9


def test_paired_rule_fails_a_three_point_drop_on_1314_questions() -> None:
    now, base = _pair(1314, lost=53, gained=13, wrong_in_both=60)
    rule = check_paired(now, base)
    assert not rule.passed
    assert rule.numbers["drop"] == pytest.approx(40 / 1314) and rule.numbers["drop_lower"] > 0.02
    assert "not below --max-drop 0.02" in rule.message


def test_too_few_questions_cannot_show_non_inferiority() -> None:
    # 4 lost, 0 gained on 200: a 2-point observed drop; the bound is far above 2 points.
    now, base = _pair(200, lost=4, gained=0)
    rule = check_paired(now, base)
    assert not rule.passed and rule.numbers["drop_upper"] > 0.03
    assert check_paired(now, base, max_drop=0.06).passed


def test_newcombe_can_be_chosen() -> None:
    now, base = _pair(1314, lost=20, gained=12)
    rule = check_paired(now, base, interval="newcombe")
    assert rule.numbers["interval"] == "newcombe" and "(newcombe)" in rule.message


def test_only_shared_questions_are_paired() -> None:
    # The canary asks a sample of the baseline's questions: only those are compared.
    base = _baseline({i: True for i in range(1000)})
    rule = check_paired({i: True for i in range(0, 1000, 5)}, base)
    assert rule.numbers["n"] == 200 and rule.numbers["baseline_questions"] == 1000
    with pytest.raises(UsageError, match="shares no question"):
        check_paired({5000: True}, base)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_drop": 1.5}, "--max-drop must be in"), ({"confidence": 1.0}, "--confidence must be in")],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    now, base = _pair(10, 0, 0)
    with pytest.raises(UsageError, match=message):
        check_paired(now, base, **kwargs)


def test_power_grows_with_n_and_with_the_drop() -> None:
    assert paired_power(200, 0.01, 0.03, 0.02, 0.95) < paired_power(1314, 0.01, 0.03, 0.02, 0.95)
    assert paired_power(1314, 0.01, 0.03, 0.02, 0.95) < paired_power(1314, 0.01, 0.05, 0.02, 0.95)
    assert paired_power(1314, 0.01, 0.0, 0.02, 0.95) < 0.01


@pytest.mark.parametrize(("correct", "passed"), [(100, True), (101, True), (99, False)])
def test_floor_on_both_sides(correct: int, passed: bool) -> None:
    rule = check_floor(correct, 200, 0.5)
    assert rule.passed is passed
    assert f"({correct}/200)" in rule.message and "--min-accuracy 0.5" in rule.message
    assert ("below" in rule.message) is not passed


# --- baselines: what is refused, and why --------------------------------------------------------


def _report(**changes: Any) -> dict[str, Any]:
    ids = list(range(5, 25))
    records = [{"id": i, "correct": i % 2 == 0, "error": None} for i in ids]
    config = {"api": "completions", "num_shots": 5, "max_tokens": 512, "data_sha256": "sha"}
    config["questions_fingerprint"] = questions_fingerprint("sha", ids, 5, "completions")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "status": "pass",
        "error": None,
        "model": "m",
        "config": config,
        "records": records,
    }
    for key, value in changes.items():
        if key.startswith("config."):
            config[key.removeprefix("config.")] = value
        else:
            report[key] = value
    return report


def _write(tmp_path: Path, report: Any) -> Path:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(report))
    return path


def test_a_good_baseline_loads(tmp_path: Path) -> None:
    base = load_baseline(_write(tmp_path, _report()))
    assert (base.n, base.correct, base.api, base.max_tokens) == (20, 10, "completions", 512)


def _bad_records() -> list[dict[str, Any]]:
    records = _report()["records"]
    records[3]["error"] = "HTTP 500 (gave up after 3 retries)"
    return records


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"status": "error", "error": "10 of 200 questions failed"}, "its run did not pass (status 'error'"),
        ({"status": "gate_failed"}, "its run did not pass (status 'gate_failed'"),
        ({"schema": "sglang-pd/eval-gsm8k/v1"}, "its schema is 'sglang-pd/eval-gsm8k/v1'"),
        ({"records": []}, "holds no per-question records"),
        ({"records": _bad_records()}, "question 8 failed in that run (HTTP 500"),
        ({"config.questions_fingerprint": "0123456789abcdef"}, "the file was edited"),
        ({"config.max_tokens": "512"}, "config.max_tokens is '512'"),
        ({"records": [{"id": 5, "correct": 1}]}, "records[0].correct is 1"),
    ],
)
def test_bad_baselines_are_refused_with_the_reason(tmp_path: Path, changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(UsageError) as info:
        load_baseline(_write(tmp_path, _report(**changes)))
    assert reason in str(info.value) and "cannot be used" in str(info.value)


def test_unreadable_baselines(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="Cannot read the --baseline report"):
        load_baseline(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(UsageError, match="is not JSON"):
        load_baseline(tmp_path / "x.json")


COMPATIBLE = {"data_sha256": "sha", "api": "completions", "num_shots": 5, "max_tokens": 512}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"data_sha256": "other"}, "another data file ('sha'; this run: 'other')"),
        ({"api": "chat"}, "another API ('completions'; this run: 'chat'); run with the baseline's --api"),
        ({"num_shots": 8}, "another shot count (5; this run: 8)"),
        ({"max_tokens": 256}, "another max_tokens (512; this run: 256)"),
        ({"question_ids": range(5, 30)}, "5 of this run's 25 questions are not in it (ids 25, 26, 27, 28, 29"),
    ],
)
def test_incompatible_baselines_are_refused(tmp_path: Path, changes: dict[str, Any], reason: str) -> None:
    base = load_baseline(_write(tmp_path, _report()))
    with pytest.raises(UsageError) as info:
        check_compatible(base, **{**COMPATIBLE, "question_ids": range(5, 25), **changes})
    assert reason in str(info.value)


def test_a_subset_of_the_baseline_questions_is_compatible(tmp_path: Path) -> None:
    base = load_baseline(_write(tmp_path, _report()))
    check_compatible(base, **COMPATIBLE, question_ids=[5, 9, 17])
