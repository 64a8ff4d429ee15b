"""End to end against `sglang-pd up` (the reference engines behind our router, real processes on loopback):
eight questions, the report is written, and a floor of 0.5 fails (a tiny random model scores about 0)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.polling import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_pd.deploy.ops.up") is None,
        reason="`sglang-pd up` (sglang_pd.deploy.ops.up) is not in this checkout yet",
    ),
]

READY_TIMEOUT_S = 180.0
CLI = [sys.executable, "-m", "sglang_pd.deploy.cli"]


@contextlib.contextmanager
def _stack() -> Iterator[str]:
    """Start `sglang-pd up --port P` and yield the printed OpenAI base URL; stop the whole group after."""
    proc = subprocess.Popen(
        # --no-kv-firewall: this machine's netfilter rules stay untouched (tests/deploy/kv/test_firewall.py
        # runs the fenced `up` in a network namespace of its own).
        [*CLI, "up", "--port", str(free_port()), "--no-kv-firewall"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"OpenAI API: (http://\S+/v1)", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(READY_TIMEOUT_S)
        if not found:
            tail = "".join(lines[-40:])
            pytest.fail(f"`sglang-pd up` printed no 'OpenAI API:' line in {READY_TIMEOUT_S:g} s:\n{tail}")
        yield found[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # our own group: started with start_new_session
                proc.wait(timeout=10)
        reader.join(timeout=10)


QUESTIONS = 8  # two rounds of --parallel 4: enough to exercise the pipeline, which is what is under test


@pytest.mark.serial  # the whole stack and the gate: needs both cores
def test_gate_against_sglang_pd_up(gsm8k_path: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    with _stack() as base_url:
        start = time.monotonic()
        flags = ["--data", str(gsm8k_path), "--num-questions", str(QUESTIONS), "--max-tokens", "16", "--parallel", "4"]
        flags += ["--min-accuracy", "0.5", "--wait-ready", "60", "--timeout", "240", "--quiet"]
        # 16 tokens cut most answers of this tiny model: the pipeline is under test here, not the model.
        flags += ["--max-truncation-rate", "1"]
        flags += ["--output", str(report_path)]
        result = subprocess.run(
            [*CLI, "eval", "gsm8k", "--base-url", base_url, *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        elapsed = time.monotonic() - start
    assert result.returncode == 1, f"exit {result.returncode} after {elapsed:.0f} s:\n{result.stdout}\n{result.stderr}"
    assert re.search(
        r"gate failed \(min_accuracy\): accuracy 0\.\d{4} \(\d+/8\) is below the floor --min-accuracy 0\.5",
        result.stderr,
    ), result.stderr
    report = json.loads(report_path.read_text())
    assert report["status"] == "gate_failed" and report["metrics"]["errors"] == 0
    assert report["metrics"]["n"] == QUESTIONS
    assert report["metrics"]["truncated"] > 0 and all(isinstance(r["label"], str) for r in report["records"])
    assert report["endpoint"] == base_url and report["model"]
    assert len(report["records"]) == QUESTIONS and all(r["output"] is not None for r in report["records"])
