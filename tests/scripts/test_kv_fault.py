"""The GPU check's KV-page fault (scripts/gpu/faults/): armed only where the check arms it, and then it
changes what sglang's Mooncake prefill writes, only while its flag file exists.

The write is sglang 0.5.17's own `MooncakeKVManager.send_kvcache` (the release the GPU check runs,
kept under .venv/sglang-0.5.17) through sglang's MooncakeTransferEngine and the non-CUDA Mooncake
wheel over TCP on loopback: kv_fault_driver.py."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "scripts/gpu/faults"
SGLANG_0517 = REPO / ".venv/sglang-0.5.17"
sys.path.insert(0, str(REPO / "scripts/gpu"))
check = importlib.import_module("gpu_pd_check")
sys.path.insert(0, str(FAULTS))
fault = importlib.import_module("pd_check_kv_fault")

PROBE = (
    "import json, sys; print(json.dumps({"
    "'armed': any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path),"
    "'fault_module': 'pd_check_kv_fault' in sys.modules,"
    "'chained': getattr(sys.modules.get('_pd_check_chained_sitecustomize'), 'MARK', None)}))"
)


def _python(code: str, env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PD_CHECK_KV_FAULT")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_fault_is_armed_only_with_the_checks_folder_and_flag(tmp_path: Path) -> None:
    flag = {fault.FLAG_ENV: str(tmp_path / "on"), fault.LOG_ENV: str(tmp_path / "log")}
    assert _python(PROBE, {"PYTHONPATH": str(FAULTS), **flag})["armed"] is True
    # The folder without the flag variable, and the variable without the folder: nothing armed.
    assert _python(PROBE, {"PYTHONPATH": str(FAULTS)}) == {"armed": False, "fault_module": False, "chained": None}
    assert _python(PROBE, {"PYTHONPATH": "", **flag})["armed"] is False


def test_the_machines_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("MARK = 'the machine ran its own'\n")
    env = {"PYTHONPATH": os.pathsep.join([str(FAULTS), str(other)]), fault.FLAG_ENV: str(tmp_path / "on")}
    got = _python(PROBE, env)
    assert got["chained"] == "the machine ran its own" and got["armed"] is True


def test_only_the_pd_stack_gets_the_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/tmp/pd:/bundle/site")
    env = check.fault_env(tmp_path)
    assert env["PYTHONPATH"] == os.pathsep.join([str(FAULTS), "/tmp/pd", "/bundle/site"])  # first, then the rest
    assert env[check.FAULT_FLAG_ENV] == str(tmp_path / "kv-fault.on")
    assert (check.FAULT_FLAG_ENV, check.FAULT_LOG_ENV) == (fault.FLAG_ENV, fault.LOG_ENV)
    assert not (tmp_path / "kv-fault.on").exists()  # armed, but off until the control turns it on
    # The single server and every other process the check starts inherit the check's own environment.
    assert fault.FLAG_ENV not in os.environ and str(FAULTS) not in os.environ.get("PYTHONPATH", "")


def test_corrupt_sends_the_first_page_as_the_second_and_leaves_sglangs_list_alone() -> None:
    import numpy as np

    pages = np.array([40, 41, 42, 43], dtype=np.int32)
    wrong = fault.corrupt(pages)
    assert wrong.tolist() == [40, 40, 42, 43] and pages.tolist() == [40, 41, 42, 43]
    assert fault.corrupt(np.array([7], dtype=np.int32)) is None  # one page: nothing to misplace
    assert fault.corrupt([1, 2]) == [1, 1]


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_0517.is_dir(), reason="sglang 0.5.17 is not unpacked under .venv")
def test_the_fault_changes_what_sglang_writes_only_while_the_flag_exists(tmp_path: Path) -> None:
    flag, log = tmp_path / "kv-fault.on", tmp_path / "kv-fault.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PD_CHECK_KV_FAULT")},
        "PYTHONPATH": os.pathsep.join([str(FAULTS), str(SGLANG_0517)]),
        fault.FLAG_ENV: str(flag),
        fault.LOG_ENV: str(log),
        "MC_FORCE_TCP": "1",
        "MOONCAKE_PROTOCOL": "tcp",
    }
    driver = Path(__file__).with_name("kv_fault_driver.py")
    run = subprocess.run([sys.executable, str(driver), str(flag)], env=env, capture_output=True, text=True, timeout=180)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(line[len("RESULT ") :])
    assert got["sglang"] == "0.5.17" and got["wrapped"] is True
    expected = got["expected"]  # per layer, the values of prefill pages 3, 5, 6, 9
    assert got["flag_absent"] == {"ret": 0, "held": expected, "pages_whole": True}
    # With the flag, the second page of the chunk holds the first page's KV, in every layer.
    corrupted = [[row[0], row[0], row[2], row[3]] for row in expected]
    assert got["flag_present"] == {"ret": 0, "held": corrupted, "pages_whole": True}
    assert got["flag_present_one_page"]["held"] == [[8], [58]]  # page 7 of each layer, untouched
    assert got["flag_removed"] == {"ret": 0, "held": [row[:3] for row in expected], "pages_whole": True}
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["armed", "fault"]
    assert events[1]["prefill_pages"] == [3, 5, 6, 9] and events[1]["sent_pages"] == [3, 3, 6, 9]
