"""`sglang-pd doctor` prints its table, not sglang's import-time UserWarnings about GPU backends this machine
lacks. Through a real `sglang-pd` process; the control imports the same sglang module without doctor's filter."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

# A module sglang imports on doctor's path that warns where CUDA is absent (srt/layers/quantization/awq/awq.py).
WARNS = "sglang.srt.layers.quantization.awq.awq"


def test_doctor_prints_no_sglang_user_warnings() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("sglang ") and "sglang plugin" in r.stdout, r.stdout


def test_control_the_same_import_without_the_filter_warns() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("sglang does not warn where CUDA is present")
    r = subprocess.run([sys.executable, "-c", f"import {WARNS}"], capture_output=True, text=True, timeout=300)
    assert "UserWarning" in r.stderr, r.stderr[-2000:]
