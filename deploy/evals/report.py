"""The report: metrics from the records, JSON for machines (`--output`) and a short table for people.

Accuracy counts every question asked (a failed request is a wrong answer). Infrastructure is
counted apart from accuracy: failed questions (after retries), questions whose first attempt failed,
malformed responses and truncated answers each have their own rate and their own limit. The three
scores (`scoring`) are reported side by side with how often they disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

from .gate import SCHEMA, GateResult
from .runner import QuestionRecord, RunResult

__all__ = [
    "SCHEMA",
    "SCORES",
    "Metrics",
    "Report",
    "compute_metrics",
    "format_table",
    "minimal_report",
    "percentile",
    "project_version",
    "write_json",
]

# The three scores: report key → (record field, what it is).
SCORES = {
    "run_eval": ("correct", "sglang run_eval: last number (the gate's score)"),
    "lm_eval_strict": ("strict_correct", "lm-eval strict-match: first '#### N'"),
    "last_explicit": ("explicit_correct", "sglang last_explicit: last '#### N', else last number"),
}


def project_version() -> str:
    try:
        return metadata.version("sglang-pd")
    except metadata.PackageNotFoundError:
        return "unknown"


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _rate(count: int, n: int) -> float:
    return count / n if n else 0.0


@dataclass(frozen=True, slots=True)
class Metrics:
    n: int
    correct: int
    accuracy: float
    # Answers with no number in them (the model's fault, not the endpoint's).
    invalid: int
    invalid_rate: float
    # Questions that failed after retries.
    errors: int
    error_rate: float
    retries: int
    # Questions whose first attempt failed transiently (then retried).
    first_attempt_failures: int
    retry_rate: float
    # Questions that got a malformed 200 (retried once).
    invalid_responses: int
    invalid_response_rate: float
    # Answers cut by max_tokens (finish_reason "length").
    truncated: int
    truncation_rate: float
    # Accuracy under each of SCORES, and the fraction of questions on which two scores disagree.
    scores: dict[str, float]
    disagreement: dict[str, float]
    latency_s: dict[str, float | None]
    output_tokens: int | None
    output_tokens_per_s: float | None
    wall_s: float


def compute_metrics(run: RunResult) -> Metrics:
    records = run.records
    n = len(records)
    correct = sum(r.correct for r in records)
    invalid = sum(r.invalid for r in records)
    errors = sum(r.error is not None for r in records)
    first = sum(r.first_attempt_failed for r in records)
    malformed = sum(r.invalid_responses > 0 for r in records)
    truncated = sum(r.truncated for r in records)
    latencies = [r.latency_s for r in records if r.latency_s is not None]
    tokens = [r.completion_tokens for r in records if r.error is None]
    output_tokens = sum(t for t in tokens if t is not None) if tokens and None not in tokens else None
    scores = {key: _rate(sum(getattr(r, attr) for r in records), n) for key, (attr, _) in SCORES.items()}
    keys = list(SCORES)
    disagreement = {
        f"{a}/{b}": _rate(sum(getattr(r, SCORES[a][0]) != getattr(r, SCORES[b][0]) for r in records), n)
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
    }
    return Metrics(
        n=n,
        correct=correct,
        accuracy=_rate(correct, n),
        invalid=invalid,
        invalid_rate=_rate(invalid, n),
        errors=errors,
        error_rate=_rate(errors, n),
        retries=run.retries,
        first_attempt_failures=first,
        retry_rate=_rate(first, n),
        invalid_responses=malformed,
        invalid_response_rate=_rate(malformed, n),
        truncated=truncated,
        truncation_rate=_rate(truncated, n),
        scores=scores,
        disagreement=disagreement,
        latency_s={
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "max": max(latencies) if latencies else None,
            "mean": sum(latencies) / len(latencies) if latencies else None,
        },
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / run.wall_s if output_tokens is not None and run.wall_s > 0 else None,
        wall_s=run.wall_s,
    )


@dataclass(frozen=True, slots=True)
class Report:
    endpoint: str
    api: str
    model: str
    config: dict[str, Any]
    run: RunResult
    metrics: Metrics
    gate: GateResult | None
    # "pass", "gate_failed" or "error"; `error` says why when not "pass".
    status: str
    error: str | None = None
    # Things a person should look at that do not change the verdict (e.g. the scores disagree).
    warnings: tuple[str, ...] = ()

    def to_dict(self, *, outputs: bool = True) -> dict[str, Any]:
        """The JSON report; `outputs=False` leaves out the model outputs (a compact baseline)."""
        return {
            "schema": SCHEMA,
            "status": self.status,
            "error": self.error,
            "warnings": list(self.warnings),
            "tool": {"name": "sglang-pd", "version": project_version()},
            "time": {
                "started": self.run.started_at.isoformat(timespec="seconds"),
                "finished": (self.run.started_at + timedelta(seconds=self.run.wall_s)).isoformat(timespec="seconds"),
                "wall_s": round(self.run.wall_s, 3),
            },
            "endpoint": self.endpoint,
            "api": self.api,
            "model": self.model,
            "config": self.config,
            "stopped_early": self.run.stopped,
            "metrics": dataclasses.asdict(self.metrics),
            "gate": None
            if self.gate is None
            else {"passed": self.gate.passed, "rules": [dataclasses.asdict(r) for r in self.gate.rules]},
            "records": [_record(r, outputs) for r in self.run.records],
        }

    def write(self, path: Path, *, outputs: bool = True) -> None:
        """Write atomically; should the report not serialise (a bug), a minimal error report is written instead."""
        try:
            text = json.dumps(self.to_dict(outputs=outputs), indent=1, allow_nan=False)
        except (TypeError, ValueError) as exc:
            text = json.dumps(
                minimal_report(f"internal error: the report did not serialise ({type(exc).__name__}: {exc})"),
                indent=1,
            )
        write_json(path, text)


def minimal_report(error: str) -> dict[str, Any]:
    """The report written when no run result exists (an unexpected error before or around the run)."""
    return {
        "schema": SCHEMA,
        "status": "error",
        "error": error,
        "warnings": [],
        "tool": {"name": "sglang-pd", "version": project_version()},
        "records": [],
    }


def write_json(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, so that a Job killed mid-write never leaves half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _record(r: QuestionRecord, outputs: bool) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    if not outputs:
        del d["output"]
    return d


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: Report) -> str:
    m = report.metrics
    lat = m.latency_s
    scores = "  ".join(f"{key} {value:.4f}" for key, value in m.scores.items())
    rows = [
        ("endpoint", f"{report.endpoint} ({report.api})"),
        ("model", report.model),
        ("questions", f"{m.n}"),
        ("accuracy", f"{m.accuracy:.4f}  ({m.correct}/{m.n})"),
        ("scores", scores),
        ("no number in answer", f"{m.invalid_rate:.4f}  ({m.invalid})"),
        ("errors / retries", f"{m.errors} / {m.retries}"),
        ("first-attempt failures", f"{m.retry_rate:.4f}  ({m.first_attempt_failures})"),
        ("malformed responses", f"{m.invalid_response_rate:.4f}  ({m.invalid_responses})"),
        ("truncated answers", f"{m.truncation_rate:.4f}  ({m.truncated})"),
        ("latency p50/p90/p99", f"{_fmt(lat['p50'], '.3f')} / {_fmt(lat['p90'], '.3f')} / {_fmt(lat['p99'], '.3f')} s"),
        ("output tokens/s", _fmt(m.output_tokens_per_s, ".1f")),
        ("wall time", f"{m.wall_s:.1f} s"),
    ]
    if report.gate is not None:
        for r in report.gate.rules:
            rows.append((f"gate {r.rule}", f"{'PASS' if r.passed else 'FAIL'}: {r.message}"))
    for w in report.warnings:
        rows.append(("warning", w))
    rows.append(("result", report.status.upper() + (f": {report.error}" if report.error else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
