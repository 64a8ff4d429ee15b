"""The rollout gate: an accuracy floor, and a drop from a baseline report tested for significance.

The baseline rule is a one-sided test on two proportions with a margin: with `p0` the baseline's
accuracy on `n0` questions and `p1` this run's on `n1`, the hypothesis "the drop `p0 - p1` is at most
D" is rejected, and the gate fails, when

    z = ((p0 - p1) - D) / sqrt(p0 (1 - p0) / n0 + p1 (1 - p1) / n1)  >  z_confidence

(the unpooled standard error, since under a non-zero margin the two proportions differ). Noise on a
few hundred questions therefore does not fail a good rollout, and a real regression does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from .errors import UsageError

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_MAX_DROP",
    "Baseline",
    "GateResult",
    "RuleResult",
    "check_baseline",
    "check_floor",
    "load_baseline",
]

DEFAULT_CONFIDENCE = 0.95
DEFAULT_MAX_DROP = 0.01


@dataclass(frozen=True, slots=True)
class RuleResult:
    rule: str
    passed: bool
    message: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GateResult:
    rules: tuple[RuleResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rules)

    @property
    def failures(self) -> tuple[RuleResult, ...]:
        return tuple(r for r in self.rules if not r.passed)


@dataclass(frozen=True, slots=True)
class Baseline:
    path: Path
    correct: int
    n: int
    model: str | None
    questions_fingerprint: str | None

    @property
    def accuracy(self) -> float:
        return self.correct / self.n


def load_baseline(path: Path) -> Baseline:
    """Read an earlier `--output` report."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"Cannot read the --baseline report {path}: {exc.strerror or exc}.") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"--baseline {path} is not JSON ({exc}); pass a report written by --output.") from exc
    try:
        metrics = report["metrics"]
        correct, n = metrics["correct"], metrics["n"]
        if not (isinstance(correct, int) and isinstance(n, int) and 0 <= correct <= n and n > 0):
            raise ValueError(f"correct={correct!r}, n={n!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(
            f"--baseline {path} is not a gsm8k report of this tool (metrics.correct / metrics.n: {exc}); "
            "pass a report written by `sglang-pd eval gsm8k --output`."
        ) from exc
    config = report.get("config") or {}
    return Baseline(path, correct, n, report.get("model"), config.get("questions_fingerprint"))


def _check_unit(name: str, value: float, *, closed: bool = True) -> None:
    ok = 0.0 <= value <= 1.0 if closed else 0.0 < value < 1.0
    if not ok:
        interval = "[0, 1]" if closed else "(0, 1)"
        raise UsageError(f"{name} must be in {interval}, not {value}.")


def check_floor(correct: int, n: int, min_accuracy: float) -> RuleResult:
    """Fails when the accuracy is below `min_accuracy` (a plain floor, no test)."""
    _check_unit("--min-accuracy", min_accuracy)
    accuracy = correct / n if n else 0.0
    passed = accuracy >= min_accuracy
    verdict = "meets" if passed else "is below"
    return RuleResult(
        rule="min_accuracy",
        passed=passed,
        message=f"accuracy {accuracy:.4f} ({correct}/{n}) {verdict} the floor --min-accuracy {min_accuracy:g}",
        numbers={"accuracy": accuracy, "correct": correct, "n": n, "min_accuracy": min_accuracy},
    )


def check_baseline(
    correct: int,
    n: int,
    baseline: Baseline,
    *,
    max_drop: float = DEFAULT_MAX_DROP,
    confidence: float = DEFAULT_CONFIDENCE,
    questions_fingerprint: str | None = None,
) -> RuleResult:
    """Fails when the drop from `baseline` exceeds `max_drop` at one-sided `confidence`."""
    _check_unit("--max-drop", max_drop)
    _check_unit("--confidence", confidence, closed=False)
    p0, n0, p1, n1 = baseline.accuracy, baseline.n, correct / n, n
    drop = p0 - p1
    se = math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1)
    z_crit = NormalDist().inv_cdf(confidence)
    if se > 0:
        z = (drop - max_drop) / se
        p_value = 1.0 - NormalDist().cdf(z)
    else:
        # Both runs all right or all wrong: no noise to allow for, the observed drop decides.
        z = math.inf if drop > max_drop else -math.inf
        p_value = 0.0 if drop > max_drop else 1.0
    passed = p_value >= 1.0 - confidence
    same = questions_fingerprint is not None and questions_fingerprint == baseline.questions_fingerprint
    verdict = "within" if passed else "exceeds"
    message = (
        f"accuracy {p1:.4f} ({correct}/{n}) vs baseline {p0:.4f} ({baseline.correct}/{n0}, {baseline.path}): "
        f"drop {drop:+.4f} {verdict} --max-drop {max_drop:g} at confidence {confidence:g} "
        f"(one-sided z={z:.2f}, critical {z_crit:.2f}, p={p_value:.4f})"
    )
    if not same:
        message += "; note: the baseline asked a different set of questions"
    return RuleResult(
        rule="baseline",
        passed=passed,
        message=message,
        numbers={
            "accuracy": p1,
            "correct": correct,
            "n": n,
            "baseline_accuracy": p0,
            "baseline_correct": baseline.correct,
            "baseline_n": n0,
            "baseline_path": str(baseline.path),
            "drop": drop,
            "max_drop": max_drop,
            "confidence": confidence,
            "z": z if math.isfinite(z) else None,
            "z_critical": z_crit,
            "p_value": p_value,
            "same_questions": same,
        },
    )
