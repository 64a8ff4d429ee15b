"""The chaos suite's figures (benchmarks/bench_chaos.py), from requests and gauges whose answer is known."""

from __future__ import annotations

import pytest

from benchmarks.bench_chaos import Request, goodput_recovery_s, leftovers, main, percentile, summarize, table


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(101)], 0.99) == 99.0


def _steady(start: float, end: float, per_s: int) -> list[tuple[float, int]]:
    """One answer of `per_s` tokens every second in [start, end)."""
    return [(start + i + 0.5, per_s) for i in range(int(end - start))]


def test_recovery_is_when_full_goodput_returns_for_good() -> None:
    # 10 tokens/s before the fault at 6 s, nothing for 4 s, then 10 tokens/s again from 10 s.
    ends = _steady(0, 6, 10) + _steady(10, 30, 10)
    # from the window [9.75, 12.75) on, every window holds 3 answers: full goodput 3.75 s after the fault
    assert goodput_recovery_s(ends, (0, 6), 6, 30, window=3, share=0.9) == 3.75
    # A burst of answers right after the fault, then the dip: recovery is after the dip.
    burst = [*_steady(0, 6, 10), (6.1, 60), *_steady(12, 30, 10)]
    assert goodput_recovery_s(burst, (0, 6), 6, 30, window=3, share=0.9) == 5.75
    # A dip that never ends is no recovery; half the goodput is not "full".
    assert goodput_recovery_s(_steady(0, 6, 10), (0, 6), 6, 30, window=3, share=0.9) is None
    assert goodput_recovery_s(_steady(0, 6, 10) + _steady(6, 30, 5), (0, 6), 6, 30, window=3, share=0.9) is None
    # A fault that costs nothing: full goodput from the fault on (the defaults: 5 s windows at 80 %).
    assert goodput_recovery_s(_steady(0, 30, 10), (0, 6), 6, 30) == 0.0


def test_leftovers_sum_engines_router_and_workers() -> None:
    engines = [
        {
            'sglang_pd_refengine_kv_pages_used{role="decode"}': 3.0,
            'sglang_pd_refengine_bootstrap_rooms{role="decode"}': 0,
        },
        {'sglang_pd_refengine_bootstrap_rooms{role="prefill"}': 1.0},
    ]
    router = {"sglang_pd_router_active_requests": 2.0}
    workers = {
        "prefill": [{"in_flight": 1, "capacity": {"admitted": 1, "admitted_tokens": 40}}],
        "decode": [{"in_flight": 0, "capacity": {"admitted": 0, "admitted_tokens": 0}}],
    }
    left = leftovers(engines, router, workers)
    assert left["kv_pages_used"] == 3 and left["bootstrap_rooms"] == 1
    assert left["router_active_requests"] == 2 and left["router_worker_in_flight"] == 1
    assert left["router_worker_admitted"] == 1 and left["router_worker_admitted_tokens"] == 40
    idle = leftovers([{}], {}, {"prefill": [{"in_flight": 0, "capacity": {}}], "decode": []})
    assert not any(idle.values()), idle


def test_summarize_sorts_requests_by_outcome() -> None:
    reference = {0: [1, 2, 3], 1: [4, 5, 6]}
    requests = [
        Request(0, 0, "a", start=0.0, end=2.0, ids=[1, 2, 3], began=True, done=True),  # identical
        Request(1, 1, "b", start=0.0, end=3.5, ids=[4, 5, 6], began=True, done=True),  # identical, moved
        Request(2, 1, "c", start=0.0, end=2.0, ids=[4, 5, 7], began=True, done=True),  # completed, differs
        Request(3, 0, "d", start=5.0, end=9.0, began=True, error="error event"),  # cut 4 s after the fault at 5 s
        Request(4, 0, "e", start=1.0, end=60.0, began=True, hung=True),
        Request(5, 0, "f", start=6.0, end=6.1, error="ConnectError"),  # refused: the router was away
        Request(6, 2, "g", start=6.0, end=8.0, ids=[9], began=True, done=True),  # no reference to compare
    ]
    got = summarize(requests, reference, moved={"b"}, fault_at=5.0, base_e2e=2.0)
    assert got["requests"] == 7 and got["completed"] == 4 and got["refused"] == 1 and got["cut"] == 1
    assert got["completion_rate"] == round(4 / 6, 4) and got["attempt_completion_rate"] == round(4 / 7, 4)
    assert got["identical"] == 2 and got["compared"] == 3 and got["hung"] == 1 and got["migrated"] == 1
    assert got["added_latency_s"] == {"p50": 1.5, "p99": 1.5}
    assert got["time_to_error_s"] == {"p50": 4.0, "max": 4.0}
    assert "fault" not in table([{**got, "fault": "x", "leftovers": {}, "recovery_s": None}]).splitlines()[1]


def test_bad_arguments_name_the_problem(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--faults", "decode_kill,meteor"])
    assert exc.value.code == 2
    assert "unknown fault(s) meteor; choose from none, decode_kill" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--clients", "0"])
    assert "--clients has value 0" in capsys.readouterr().err
