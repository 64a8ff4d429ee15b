"""--fault-kv-noise, the fault that makes a bad revision: a prefill overwrites its KV with noise before the checksum,
so the decode's integrity check passes and the answer changes (only an accuracy check can see it). The control, the
same decode with a prefill without the flag, answers what one process computes. The flag outside a prefill is
refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import greedy_reference, launcher
from .test_faults import PARAMS, PROMPT, _pd_generate

pytestmark = pytest.mark.slow


def test_noisy_kv_passes_the_check_and_changes_the_answer(tmp_path: Path, reference_model) -> None:  # type: ignore[no-untyped-def]
    expected = greedy_reference(reference_model, PROMPT, PARAMS["max_new_tokens"])
    with launcher(tmp_path) as lx:
        faulty = lx.engine("prefill", name="prefill-noise", args=["--fault-kv-noise"])
        healthy = lx.engine("prefill", name="prefill-healthy")
        decode = lx.engine("decode")  # its KV check on, the default
        lx.wait()
        _, good = asyncio.run(_pd_generate(healthy, decode, room=1))
        assert good.status_code == 200 and good.json()["output_ids"] == expected, good.text
        _, bad = asyncio.run(_pd_generate(faulty, decode, room=2))
        assert bad.status_code == 200, bad.text  # the checksum was taken over the noise: nothing to detect
        tokens = bad.json()["output_ids"]
        assert tokens[0] == expected[0]  # the first token comes from the prefill's own logits
        assert tokens[1:] != expected[1:]  # the rest from the noise


def test_fault_flag_outside_a_prefill_is_refused() -> None:
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "engine", "--role", "decode", "--fault-kv-noise"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--fault-kv-noise corrupts the KV a prefill sends; give it with --role prefill, not decode" in done.stderr
