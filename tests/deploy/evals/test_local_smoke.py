"""The gate's smoke on the local stack, as docs/gsm8k-gate.md writes it: against a real `up local-cpu` (what
`make run` starts), the documented commands finish with the exit code the docs state and print the report
(accuracy, truncation, each rule's verdict, the paired one against the first run as local baseline); the
same second run with a --max-drop that 5 questions cannot show fails (exit 1)."""

from __future__ import annotations

import pytest

from tests.support.gate_smoke_scenarios import GATE_DOC, documented_commands
from tests.support.netns import netns_unavailable, run_in_netns

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # two whole stacks, one after the other: needs both cores

UNAVAILABLE = netns_unavailable()


def test_the_docs_give_two_runs_the_second_against_the_first() -> None:
    first, second = documented_commands()
    assert "--base-url http://127.0.0.1:8000/v1" in first and "--output gsm8k-local.json" in first
    assert "--baseline gsm8k-local.json" in second
    assert "Both exit 0" in GATE_DOC.read_text()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespace scenarios: {UNAVAILABLE}")
def test_the_documented_smoke_passes_against_the_local_stack() -> None:
    r = run_in_netns("tests.support.gate_smoke_scenarios:smoke_against_up", timeout_s=1500)
    up = "\n".join(r["up_output"])
    assert "OpenAI API: http://127.0.0.1:8000/v1" in up, up
    # make run's model talks: no random-weights note (that is local-cpu-mla's, test_up_random_weights.py).
    assert "has random weights" not in up
    first, second = r["runs"]
    for run in (first, second):
        assert run["exit_status"] == 0, run  # "Both exit 0"
        out = run["stdout"]
        for row in ("accuracy ", "truncated answers ", "errors / retries ", "gate min_accuracy ", "result "):
            assert any(line.startswith(row) for line in out.splitlines()), (row, out)
        assert "result                  PASS" in out, out
        # The figures the doc quotes for SmolLM2 at 128 tokens.
        assert "accuracy                0.0000  (0/5)" in out and "truncated answers       0.2000  (1)" in out, out
    assert "gate baseline_paired    PASS: paired on 5 questions" in second["stdout"], second["stdout"]
    assert "lost 0, gained 0: drop +0.0000, 0.95 upper bound +0.3511 (tango) below --max-drop 0.4" in second["stdout"]
    control = r["control"]
    assert control["exit_status"] == 1, control
    assert "gate baseline_paired    FAIL" in control["stdout"] and "--max-drop 0.3" in control["stdout"], control
    assert r["up_exit_status"] == 0
