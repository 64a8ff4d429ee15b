"""`plan --check` says what it is doing while sglang's resolver starts (seconds of silence before), on stderr,
so that `--format json` keeps stdout for the plan. Through a real `sglang-pd` process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from sglang_pd.deploy.sglang.check import sglang_available
from sglang_pd.deploy.spec.presets import PRESETS_DIR

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not sglang_available(), reason="sglang is not installed (the `validate` extra)"),
]


def _timed_run(*args: str) -> tuple[list[tuple[float, str]], list[tuple[float, str]], int]:
    """stdout and stderr lines, each with the seconds since the start at which it arrived; the exit status."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_pd.deploy.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []

    def read(stream, into) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            into.append((time.monotonic() - t0, line.rstrip("\n")))

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out)),
        threading.Thread(target=read, args=(proc.stderr, err)),
    ]
    for r in readers:
        r.start()
    code = proc.wait(timeout=300)
    for r in readers:
        r.join(timeout=10)
    return out, err, code


def test_plan_check_prints_progress_before_the_wait_and_keeps_stdout_for_the_plan() -> None:
    out, err, code = _timed_run("plan", "deepseek-r1-h200-1p1d", "--check", "--format", "json")
    assert code == 0, err
    doc = json.loads("\n".join(line for _, line in out))  # stdout is the plan alone
    said = [line for _, line in err]
    assert (
        said[0]
        == "plan --check deepseek-r1-h200-1p1d: SBO against DeepEP, then every command through sglang's resolver"
    )
    assert said[1].startswith(f"checking {len(doc['sglang_check'])} distinct command(s) with sglang's resolver"), said
    steps = [line for line in said if line.startswith("  [")]
    assert steps == [
        "  [1/3] prefill instance 0 node 0: accepted by sglang",
        "  [2/3] decode group 0 node 0: accepted by sglang",
        "  [3/3] decode group 0 node 1: accepted by sglang",
    ]
    assert "comparing the rendered flags with the installed sglang's" in said
    # The first line comes at once; the plan only after sglang's import: without these lines that is silence.
    first, plan_at = err[0][0], out[0][0]
    assert first < 8.0, err
    assert plan_at - first > 2.0, (first, plan_at)
    assert all(t < plan_at for t, _ in err), (err, plan_at)


def test_a_refused_command_is_named_in_the_progress(tmp_path: Path) -> None:
    t = yaml.safe_load((PRESETS_DIR / "single-h200.yaml").read_text())
    t["model"]["config_json"] = str(PRESETS_DIR / t["model"]["config_json"])
    t["decode"]["extra_args"] = ["--no-such-flag"]  # sglang's parser refuses it
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(t))
    _, err, code = _timed_run("plan", str(bad), "--check")
    said = [line for _, line in err]
    assert code == 1, said
    assert [line for line in said if line.startswith("  [")] == [
        "  [1/2] prefill instance 0 node 0: accepted by sglang",
        "  [2/2] decode group 0 node 0: REFUSED by sglang",
    ]
