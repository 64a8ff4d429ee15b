"""The rollout gate's rules: paired non-inferiority against a baseline report, and an accuracy floor.

The baseline rule matches this run's questions with the baseline's by id and bounds the paired drop
(b10 - b01) / n (b10: right in the baseline, wrong now; b01: the reverse) with a score interval
(`stats`). It passes only when the one-sided `confidence` upper bound of the drop is below
`max_drop`: the run must *show* that it lost less than `max_drop`, so too few questions fail rather
than pass by luck. The rule prints its counts, its bound and the power it had at this n.

A baseline is refused (UsageError, exit 2) unless it is a report of this schema that passed, has no
failed question, and asked the same way (data file, API, shots, max_tokens) a superset of this
run's questions (the canary asks a sample of the baseline's).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError
from .stats import Interval, paired_interval, paired_power

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_INTERVAL",
    "DEFAULT_MAX_DROP",
    "SCHEMA",
    "Baseline",
    "GateResult",
    "RuleResult",
    "check_compatible",
    "check_floor",
    "check_paired",
    "load_baseline",
    "questions_fingerprint",
]

SCHEMA = "sglang-pd/eval-gsm8k/v2"
DEFAULT_CONFIDENCE = 0.95
DEFAULT_MAX_DROP = 0.02
DEFAULT_INTERVAL: Interval = "tango"
# Drops whose detection power the baseline rule reports (3 and 5 accuracy points).
POWER_AT = (0.03, 0.05)
_REMAKE = "make a new baseline with `sglang-pd eval gsm8k --output` from a release that passes"


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


def questions_fingerprint(data_sha256: str, ids: Iterable[int], num_shots: int, api: str) -> str:
    """Identifies the exact questions and prompts, so that two reports can tell they are comparable."""
    joined = ",".join(str(i) for i in ids)
    return hashlib.sha256(f"{data_sha256}|{num_shots}|{api}|{joined}".encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Baseline:
    """A validated earlier report: how it asked, and whether each question (by id) was right."""

    path: Path
    model: str | None
    api: str
    num_shots: int
    max_tokens: int
    data_sha256: str
    questions_fingerprint: str
    outcomes: Mapping[int, bool]

    @property
    def n(self) -> int:
        return len(self.outcomes)

    @property
    def correct(self) -> int:
        return sum(self.outcomes.values())

    @property
    def accuracy(self) -> float:
        return self.correct / self.n


def _refuse(path: Path, problem: str, fix: str = _REMAKE) -> UsageError:
    return UsageError(f"--baseline {path} cannot be used: {problem}; {fix}.")


def _typed(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: Path, where: str) -> Any:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _refuse(path, f"{where}{key} is {value!r}, not a valid value (the file is not a complete report)")
    return value


def load_baseline(path: Path) -> Baseline:
    """Read and validate an earlier `--output` report (see the module docstring for what is refused)."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"Cannot read the --baseline report {path}: {exc.strerror or exc}.") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--baseline {path} is not JSON ({exc}); pass a report written by --output.") from exc
    if not isinstance(report, dict):
        raise _refuse(path, "it is not a JSON object")
    schema = report.get("schema")
    if schema != SCHEMA:
        raise _refuse(path, f"its schema is {schema!r}, not {SCHEMA!r} (another tool, or another version of this one)")
    status, error = report.get("status"), report.get("error")
    if status != "pass":
        raise _refuse(path, f"its run did not pass (status {status!r}: {error or 'no reason given'})")
    config = report.get("config")
    if not isinstance(config, dict):
        raise _refuse(path, "it has no config section")
    api = _typed(config, "api", str, path, "config.")
    num_shots = _typed(config, "num_shots", int, path, "config.")
    max_tokens = _typed(config, "max_tokens", int, path, "config.")
    data_sha256 = _typed(config, "data_sha256", str, path, "config.")
    fingerprint = _typed(config, "questions_fingerprint", str, path, "config.")
    records = report.get("records")
    if not isinstance(records, list) or not records:
        raise _refuse(path, "it holds no per-question records (the paired rule needs them)")
    outcomes: dict[int, bool] = {}
    for i, r in enumerate(records):
        rid = _typed(r, "id", int, path, f"records[{i}].")
        correct = _typed(r, "correct", bool, path, f"records[{i}].")
        if r.get("error") is not None:
            raise _refuse(path, f"question {rid} failed in that run ({r['error']}); a baseline must have no errors")
        if rid in outcomes:
            raise _refuse(path, f"question {rid} appears twice in its records")
        outcomes[rid] = correct
    recomputed = questions_fingerprint(data_sha256, outcomes, num_shots, api)
    if recomputed != fingerprint:
        raise _refuse(
            path,
            f"its records do not match its questions_fingerprint ({recomputed} vs {fingerprint}): the file was edited",
        )
    model = report.get("model")
    return Baseline(
        path=path,
        model=model if isinstance(model, str) else None,
        api=api,
        num_shots=num_shots,
        max_tokens=max_tokens,
        data_sha256=data_sha256,
        questions_fingerprint=fingerprint,
        outcomes=outcomes,
    )


def check_compatible(
    baseline: Baseline, *, data_sha256: str, api: str, num_shots: int, max_tokens: int, question_ids: Iterable[int]
) -> None:
    """Refuse (UsageError) a baseline that asked another way, or did not ask all of this run's questions."""
    for name, flag, theirs, ours in (
        ("data file", "--data", baseline.data_sha256, data_sha256),
        ("API", "--api", baseline.api, api),
        ("shot count", "--num-shots", baseline.num_shots, num_shots),
        ("max_tokens", "--max-tokens", baseline.max_tokens, max_tokens),
    ):
        if theirs != ours:
            raise _refuse(
                baseline.path,
                f"it was run with another {name} ({theirs!r}; this run: {ours!r})",
                f"run with the baseline's {flag}, or {_REMAKE}",
            )
    ids = list(question_ids)
    missing = [i for i in ids if i not in baseline.outcomes]
    if missing:
        shown = ", ".join(str(i) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise _refuse(
            baseline.path,
            f"{len(missing)} of this run's {len(ids)} questions are not in it (ids {shown}; its questions_fingerprint "
            f"{baseline.questions_fingerprint})",
            f"ask the baseline's questions (its --num-questions, --sample, --seed) or a subset of them, or {_REMAKE}",
        )


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


def check_paired(
    outcomes: Mapping[int, bool],
    baseline: Baseline,
    *,
    max_drop: float = DEFAULT_MAX_DROP,
    confidence: float = DEFAULT_CONFIDENCE,
    interval: Interval = DEFAULT_INTERVAL,
) -> RuleResult:
    """Paired non-inferiority of this run's `outcomes` (id → right) against `baseline` on the same ids."""
    _check_unit("--max-drop", max_drop)
    _check_unit("--confidence", confidence, closed=False)
    ids = [i for i in outcomes if i in baseline.outcomes]
    n = len(ids)
    if n == 0:
        raise UsageError(f"--baseline {baseline.path} shares no question with this run.")
    b10 = sum(baseline.outcomes[i] and not outcomes[i] for i in ids)
    b01 = sum(outcomes[i] and not baseline.outcomes[i] for i in ids)
    both = sum(baseline.outcomes[i] and outcomes[i] for i in ids)
    base_acc, acc = (both + b10) / n, (both + b01) / n
    drop = (b10 - b01) / n
    lower, upper = paired_interval(b10, b01, n, confidence=confidence, method=interval, both=both)
    passed = upper < max_drop
    flip_rate = (b10 + b01) / (2 * n)
    power = {f"{d:g}": paired_power(n, flip_rate, d, max_drop, confidence) for d in POWER_AT}
    verdict = "below" if passed else "not below"
    power_text = ", ".join(f"{float(d) * 100:g}-point drop {p:.0%}" for d, p in power.items())
    message = (
        f"paired on {n} questions: accuracy {acc:.4f} vs baseline {base_acc:.4f} ({baseline.path}); "
        f"lost {b10}, gained {b01}: drop {drop:+.4f}, {confidence:g} upper bound {upper:+.4f} ({interval}) "
        f"{verdict} --max-drop {max_drop:g}; power at this n: {power_text}"
    )
    return RuleResult(
        rule="baseline_paired",
        passed=passed,
        message=message,
        numbers={
            "n": n,
            "b10": b10,
            "b01": b01,
            "both_correct": both,
            "accuracy": acc,
            "baseline_accuracy": base_acc,
            "baseline_path": str(baseline.path),
            "baseline_questions": baseline.n,
            "drop": drop,
            "drop_lower": lower,
            "drop_upper": upper,
            "max_drop": max_drop,
            "confidence": confidence,
            "interval": interval,
            "flip_rate": flip_rate,
            "power": power,
        },
    )
