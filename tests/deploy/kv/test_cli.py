"""`sglang-pd kv-probe`: passes on loopback, fails with an actionable diagnosis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .test_engine import free_port

PROBE = [sys.executable, "-m", "sglang_pd.deploy.cli", "kv-probe", "--format", "json", "--repeat", "2"]


def test_kv_probe_on_loopback_passes() -> None:
    r = subprocess.run([*PROBE, "--pages", "32", "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"] and {c["check"] for c in report["checks"]} >= {"engine", "register", "probe", "integrity"}
    assert {row["shape"] for row in report["bandwidth"]} == {"contiguous", "fragmented"}
    assert all(row["best_gbps"] > 0 for row in report["bandwidth"])


@pytest.mark.parametrize(
    ("args", "diagnosis"),
    [
        (["--peer", "http://127.0.0.1:{port}"], "start `sglang-pd kv-probe --serve` there"),
        (["--protocol", "rdma", "--device", "mlx5_missing"], "mount /dev/infiniband"),
    ],
)
def test_kv_probe_failures_say_what_to_do(args: list[str], diagnosis: str) -> None:
    args = [a.format(port=free_port()) for a in args]
    r = subprocess.run([*PROBE, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and diagnosis in report["diagnosis"]
