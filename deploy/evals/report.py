"""The report: metrics from the records, JSON for machines (`--output`) and a short table for people.

Accuracy counts every question asked (a failed request is a wrong answer); the invalid rate counts
answers without a number; errors and retries are counted apart, never dropped.
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

from .gate import GateResult
from .runner import QuestionRecord, RunResult

__all__ = ["SCHEMA", "Metrics", "Report", "compute_metrics", "format_table", "percentile", "project_version"]

SCHEMA = "sglang-pd/eval-gsm8k/v1"


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


@dataclass(frozen=True, slots=True)
class Metrics:
    n: int
    correct: int
    accuracy: float
    invalid: int
    invalid_rate: float
    errors: int
    error_rate: float
    retries: int
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
    latencies = [r.latency_s for r in records if r.latency_s is not None]
    tokens = [r.completion_tokens for r in records if r.error is None]
    output_tokens = sum(t for t in tokens if t is not None) if tokens and None not in tokens else None
    return Metrics(
        n=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        invalid=invalid,
        invalid_rate=invalid / n if n else 0.0,
        errors=errors,
        error_rate=errors / n if n else 0.0,
        retries=run.retries,
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "status": self.status,
            "error": self.error,
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
            "records": [_record(r) for r in self.run.records],
        }

    def write(self, path: Path) -> None:
        """Write atomically, so that a Job killed mid-write never leaves half a report."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=1, allow_nan=False)
                f.write("\n")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _record(r: QuestionRecord) -> dict[str, Any]:
    return dataclasses.asdict(r)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: Report) -> str:
    m = report.metrics
    lat = m.latency_s
    rows = [
        ("endpoint", f"{report.endpoint} ({report.api})"),
        ("model", report.model),
        ("questions", f"{m.n}"),
        ("accuracy", f"{m.accuracy:.4f}  ({m.correct}/{m.n})"),
        ("invalid", f"{m.invalid_rate:.4f}  ({m.invalid})"),
        ("errors / retries", f"{m.errors} / {m.retries}"),
        ("latency p50/p90/p99", f"{_fmt(lat['p50'], '.3f')} / {_fmt(lat['p90'], '.3f')} / {_fmt(lat['p99'], '.3f')} s"),
        ("output tokens/s", _fmt(m.output_tokens_per_s, ".1f")),
        ("wall time", f"{m.wall_s:.1f} s"),
    ]
    if report.gate is not None:
        for r in report.gate.rules:
            rows.append((f"gate {r.rule}", f"{'PASS' if r.passed else 'FAIL'}: {r.message}"))
    rows.append(("result", report.status.upper() + (f": {report.error}" if report.error else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
