"""`kv-probe`'s table marks the DeepEP driver row n/a on a machine without an NVIDIA driver (it said "yes" beside
"no NVIDIA driver here"). Through a real `sglang-pd kv-probe` process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_pd.deploy.common.node import deepep_driver
from tests.support.polling import free_port

pytestmark = pytest.mark.skipif(deepep_driver()["ok"] is not None, reason="an NVIDIA driver is present here")


def test_the_driver_row_is_not_applicable_without_a_driver() -> None:
    # A peer that does not answer ends the probe at once; the advisory row is printed all the same.
    probe = [sys.executable, "-m", "sglang_pd.deploy.cli", "kv-probe", "--peer", f"http://127.0.0.1:{free_port()}"]
    r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("deepep-driver"))
    assert row.split()[1] == "n/a" and "no NVIDIA driver here" in row, row
    assert "yes" not in row.split()[1:2]
