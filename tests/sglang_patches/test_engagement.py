"""Full SBO's engagement counts: the hooks count what they route, the log lines add up, `doctor` reads them."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_pd.deploy.common.contract import EXIT_INVALID, EXIT_OK
from sglang_pd.sglang_patches import down_gemm, engagement, status


def _line(pid: int, gemm: int, combine: int, captured: int = 0) -> str:
    doc = {"pid": pid, "signal_gemm": gemm, "signal_combine": combine, "captured": captured}
    return f"[2026-12-03 10:00:00 TP0] {engagement.LINE_TAG}{json.dumps(doc)}\n"


def test_read_log_keeps_each_process_last_line_and_sums() -> None:
    log = [
        "INFO server started\n",
        _line(11, 1, 0),
        _line(11, 4, 4, captured=2),
        _line(12, 2, 2),
        f"{engagement.LINE_TAG}{{cut by a cra",  # a line a crash cut short is skipped
    ]
    counts = engagement.read_log(log)
    assert counts == engagement.Engagement(signal_gemm=6, signal_combine=6, captured=2, processes=2)
    assert counts.engaged
    assert engagement.read_log(["INFO nothing here\n"]) is None
    assert not engagement.Engagement(signal_gemm=3, signal_combine=0).engaged


def test_counts_are_logged_at_powers_of_two(capsys: pytest.CaptureFixture[str]) -> None:
    start = engagement.snapshot().signal_gemm
    for _ in range(9):
        engagement.count_signal_gemm()
    logged = [line for line in capsys.readouterr().err.splitlines() if engagement.LINE_TAG in line]
    counts = [json.loads(line.partition(engagement.LINE_TAG)[2])["signal_gemm"] for line in logged]
    assert counts == [n for n in range(start + 1, start + 10) if n & (n - 1) == 0]
    assert engagement.snapshot().signal_gemm == start + 9


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_routed_down_gemm_calls_are_counted(monkeypatch: pytest.MonkeyPatch, sm90) -> None:
    params = ("x", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms")
    monkeypatch.setattr(status, "deepep_layout", lambda: status.LayoutDecision("sglang", "test", params))
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    kernel = importlib.import_module(status.KERNEL_MODULE)
    monkeypatch.setattr(kernel, status.KERNEL_ENTRY, lambda *a, **k: (64, 2))
    overlap = type("Overlap", (), {"signal": torch.zeros(4, dtype=torch.int32), "num_sms": 129})()
    before = engagement.snapshot().signal_gemm
    down_gemm.grouped_gemm_nt_f8f8bf16_masked(lambda *a, **k: None, "lhs", "rhs", "out", "m", 8)  # no overlap
    got = down_gemm.grouped_gemm_nt_f8f8bf16_masked(lambda *a, **k: None, "a", "b", "o", "m", 8, overlap_args=overlap)
    assert got == (64, 2)
    assert engagement.snapshot().signal_gemm == before + 1


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor", "--skip-targets", "--capability", "9.0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("lines", "engaged"),
    [
        ([_line(7, 8, 8, captured=8)], True),
        ([_line(7, 8, 0)], False),
        (["INFO no SBO here\n"], False),
    ],
)
def test_doctor_reads_a_server_log(tmp_path: Path, lines: list[str], engaged: bool) -> None:
    log = tmp_path / "decode.log"
    log.write_text("".join(lines))
    out = _doctor("--server-log", str(log), "--format", "json")
    assert out.returncode == EXIT_OK, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)["server_engagement"]
    assert doc["engaged"] is engaged
    if not engaged:
        assert "signal" in doc["reason"] or "engagement line" in doc["reason"]


def test_doctor_expect_full_fails_on_a_server_that_did_not_overlap(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text(_line(7, 8, 0))
    out = _doctor("--server-log", str(log), "--expect", "full")
    assert out.returncode == EXIT_INVALID
    assert "error:" in out.stderr and ("did not run" in out.stderr or "cannot run here" in out.stderr)
    assert "SBO engaged (server log)" in out.stdout


def test_doctor_names_an_unreadable_log(tmp_path: Path) -> None:
    out = _doctor("--server-log", str(tmp_path / "missing.log"), "--format", "json")
    doc = json.loads(out.stdout)["server_engagement"]
    assert doc["engaged"] is False and "cannot read the server log" in doc["reason"]
