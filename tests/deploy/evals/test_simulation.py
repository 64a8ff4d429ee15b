"""The default baseline rule on simulated records: a 95 % model with 2 % run-to-run flips is failed at most
5 % of the time, and a 3-point drop is caught at least 90 % of the time, on all 1314 questions."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sglang_pd.deploy.evals import Baseline, check_paired
from tests.support.paths import REPO

N = 1314
SCRIPT = REPO / "scripts" / "simulate_gate.py"


@pytest.fixture(scope="module")
def simulate_gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_gate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_gate"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _records(rng: random.Random, drop: float) -> tuple[dict[int, bool], dict[int, bool]]:
    """Per-question outcomes of a baseline and a candidate run: 95 % right, 1 % lost and 1 % gained by
    run-to-run noise, and `drop` more lost by a regression."""
    base, now = {}, {}
    for qid in range(5, 5 + N):
        u = rng.random()
        if u < 0.01 + drop:
            base[qid], now[qid] = True, False
        elif u < 0.02 + drop:
            base[qid], now[qid] = False, True
        elif u < 0.95 + 0.01:
            base[qid] = now[qid] = True
        else:
            base[qid] = now[qid] = False
    return base, now


def _fail_rate(drop: float, reps: int, seed: int) -> float:
    rng = random.Random(seed)
    fails = 0
    for _ in range(reps):
        base, now = _records(rng, drop)
        baseline = Baseline(Path("b.json"), "m", "completions", 5, 512, "sha", "fp", base)
        fails += not check_paired(now, baseline).passed  # the defaults: --max-drop 0.02, 0.95, Tango
    return fails / reps


def test_default_rule_false_fail_rate_on_simulated_records() -> None:
    assert _fail_rate(0.0, reps=300, seed=1) <= 0.05


def test_default_rule_power_for_a_three_point_drop_on_simulated_records() -> None:
    assert _fail_rate(0.03, reps=300, seed=2) >= 0.90


def test_the_script_agrees_and_shows_the_old_rule_was_weaker(simulate_gate: ModuleType) -> None:
    null = simulate_gate.simulate(N, 0.0, reps=2000)
    three = simulate_gate.simulate(N, 0.03, reps=2000)
    assert null.fail_rate <= 0.05 and three.fail_rate >= 0.90
    # At 200 questions the earlier unpaired rule caught a 3-point drop about one time in ten.
    old = simulate_gate.simulate(200, 0.03, reps=2000)
    assert old.unpaired_fail_rate < 0.2 < old.fail_rate


def test_binomial_draws_have_the_right_mean(simulate_gate: ModuleType) -> None:
    rng = random.Random(0)
    for p in (0.01, 0.3, 0.93):
        mean = sum(simulate_gate.binomial(rng, 1000, p) for _ in range(2000)) / 2000
        assert mean == pytest.approx(1000 * p, rel=0.02)
