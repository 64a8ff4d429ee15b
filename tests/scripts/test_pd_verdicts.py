"""The one-GPU check's requirements (scripts/gpu/pd_verdicts.py) fail when they should: identity by
token ids, the context control and the KV-page fault control, each with a case that must pass."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
verdicts = importlib.import_module("pd_verdicts")

N = 8
IDS = [5, 9, 300, 17, 17, 800, 2, 44]


def out(ids: list[int] | None, status: int = 200) -> dict[str, object]:
    return {"status": status, "ids": ids}


def test_identical_ids_pass() -> None:
    assert verdicts.mismatch(out(IDS), out(list(IDS)), N) is None


@pytest.mark.parametrize(
    ("got", "why"),
    [
        (out([*IDS[:3], 301, *IDS[4:]]), "token 3 differs: single 17, pd 301"),
        (out(IDS[:-1]), "pd returned 7 tokens, not 8"),  # a shorter output that agrees on its prefix
        (out([*IDS, 1]), "pd returned 9 tokens, not 8"),
        (out(None), "pd returned no token ids"),
        (out(IDS, status=400), "pd answered HTTP 400"),
    ],
)
def test_any_difference_is_a_mismatch(got: dict[str, object], why: str) -> None:
    assert verdicts.mismatch(out(IDS), got, N) == why


def test_both_sides_short_alike_is_still_a_mismatch() -> None:
    # Two outputs that stopped early in the same way prove nothing about the other tokens.
    assert verdicts.mismatch(out(IDS[:4]), out(IDS[:4]), N) == "single returned 4 tokens, not 8"


def test_a_form_keeps_both_sides_ids_and_counts_only_identical_prompts() -> None:
    form = verdicts.compare_form([out(IDS), out(IDS)], [out(IDS), out(IDS[:5])], N)
    assert form["identical"] == "1/2" and form["all_identical"] is False
    assert form["prompts"][1]["single"] == {"status": 200, "ids": IDS}
    assert form["prompts"][1]["pd"] == {"status": 200, "ids": IDS[:5]}
    assert form["prompts"][1]["verdict"] == "pd returned 5 tokens, not 8"
    with pytest.raises(ValueError, match="different prompts"):
        verdicts.compare_form([out(IDS)], [], N)


def test_context_control_fails_when_two_contexts_answer_alike() -> None:
    assert verdicts.context_verdict(out(IDS), out(IDS[::-1]), N) is None
    same = verdicts.context_verdict(out(IDS), out(list(IDS)), N)
    assert same is not None and "answers from the last tokens alone" in same
    failed = verdicts.context_verdict(out(IDS), out(None, status=503), N)
    assert failed is not None and "HTTP 503" in failed


FAULT = {"event": "fault", "pid": 7, "pages": 9, "dst_page": 1, "src_page": 0}
ARMED = {"event": "armed", "pid": 7}


def test_fault_control_passes_only_when_every_control_differs_and_the_fault_fired() -> None:
    ref = [out(IDS), out(IDS[::-1])]
    corrupted = [out([*IDS[:2], 0, *IDS[3:]]), out([1, *IDS[::-1][1:]])]
    assert verdicts.fault_verdict(ref, ref, corrupted, [ARMED, FAULT, FAULT], N) is None


def test_fault_control_fails_when_the_controls_differ_without_the_fault() -> None:
    # Then a difference with the fault could be the stack's own: it shows nothing about the fault.
    ref = [out(IDS)]
    why = verdicts.fault_verdict(ref, [out(IDS[::-1])], [out([0] * N)], [FAULT], N)
    assert why is not None and "control 0 differs without the fault (token 0 differs" in why


def test_fault_control_fails_when_a_control_matches_the_reference() -> None:
    ref = [out(IDS), out(IDS[::-1])]
    got = [out([*IDS[:2], 0, *IDS[3:]]), out(IDS[::-1])]
    why = verdicts.fault_verdict(ref, ref, got, [FAULT, FAULT], N)
    assert why is not None and "control 1 gave the single server's 8 tokens" in why


def test_fault_control_fails_without_faults_in_the_log() -> None:
    ref, got = [out(IDS)], [out(IDS[::-1])]
    why = verdicts.fault_verdict(ref, ref, got, [ARMED, ARMED], N)
    assert why is not None and "no fault (the wrapper was armed in 2 processes)" in why
    assert "no fault" in (verdicts.fault_verdict(ref, ref, got, [], N) or "")
    two = [out(IDS), out(IDS)]
    fewer = verdicts.fault_verdict(two, two, [out([0] * N), out([1] * N)], [FAULT], N)
    assert fewer is not None and "1 faults for 2 control prompts" in fewer


def test_fault_control_fails_when_the_corrupted_request_errors() -> None:
    # A fault that breaks the request instead of corrupting it shows nothing about identity.
    why = verdicts.fault_verdict([out(IDS)], [out(IDS)], [out(None, status=500)], [FAULT], N)
    assert why is not None and "pd answered HTTP 500" in why


def test_the_fault_log_is_read_line_by_line(tmp_path: Path) -> None:
    log = tmp_path / "kv-fault.log"
    assert verdicts.read_fault_log(log) == []
    log.write_text(json.dumps(ARMED) + "\n" + json.dumps(FAULT) + "\n")
    assert verdicts.read_fault_log(log) == [ARMED, FAULT]
