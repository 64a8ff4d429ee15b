"""The gate's result as Prometheus metrics in a node-exporter textfile (`--metrics-textfile`).

node-exporter's textfile collector (`--collector.textfile.directory`) exports every `*.prom` file of
its directory on each scrape, so a short-lived Job (the canary CronJob) can publish a result
without a pushgateway and without a server of its own. The file is replaced atomically (written
under a name that does not end in `.prom`, then renamed), as the collector's documentation asks.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import UsageError

__all__ = ["PREFIX", "parse_labels", "render_metrics", "write_textfile"]

PREFIX = "sglang_pd_gsm8k"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (from --metrics-label) as Prometheus labels."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _LABEL_NAME.match(key) or key.startswith("__"):
            raise UsageError(
                f"--metrics-label {pair!r} is not KEY=VALUE with KEY a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)."
            )
        labels[key] = value
    return labels


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(
    report: Mapping[str, Any] | None, exit_code: int, labels: Mapping[str, str], *, now: float | None = None
) -> str:
    """The metrics of one run: its verdict always; accuracy and rates when a report exists."""
    label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    braces = f"{{{label_text}}}" if label_text else ""
    lines: list[str] = []

    def gauge(name: str, help_text: str, value: float | int | None) -> None:
        if value is None:
            return
        lines.append(f"# HELP {PREFIX}_{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}_{name} gauge")
        lines.append(f"{PREFIX}_{name}{braces} {float(value)!r}")

    gauge("gate_passed", "1 when the last gsm8k gate run exited 0, else 0.", 1 if exit_code == 0 else 0)
    gauge("gate_exit_code", "Exit code of the last gsm8k gate run (0 pass, 1 failed, 2-4 not judged).", exit_code)
    gauge(
        "last_run_timestamp_seconds",
        "Unix time the last gsm8k gate run ended.",
        time.time() if now is None else now,
    )
    metrics = (report or {}).get("metrics") or {}
    gauge("questions", "Questions asked by the last run.", metrics.get("n"))
    gauge("accuracy", "Accuracy of the last run (sglang run_eval scoring).", metrics.get("accuracy"))
    for key in ("error_rate", "retry_rate", "invalid_response_rate", "truncation_rate"):
        gauge(key, f"{key.replace('_', ' ').capitalize()} of the last run.", metrics.get(key))
    for rule in ((report or {}).get("gate") or {}).get("rules") or []:
        if rule.get("rule") == "baseline_paired":
            numbers = rule.get("numbers") or {}
            gauge("drop", "Paired accuracy drop from the baseline, (b10 - b01) / n.", numbers.get("drop"))
            gauge("drop_upper_bound", "One-sided upper confidence bound of the drop.", numbers.get("drop_upper"))
            gauge("max_drop", "The gate's --max-drop.", numbers.get("max_drop"))
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Replace `path` atomically; the temporary name never ends in `.prom`, so the collector never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # node-exporter runs as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
