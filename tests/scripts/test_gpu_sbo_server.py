"""The SBO server run's pieces that need no GPU: the commands it starts and how it compares two runs."""

from __future__ import annotations

import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
run = importlib.import_module("gpu_sbo_server")


def test_an_output_that_stops_early_is_no_match_even_where_its_prefix_agrees() -> None:
    full = {"status": 200, "ids": [1, 2, 3, 4], "logprobs": [-0.1] * 4}
    short = {"status": 200, "ids": [1, 2], "logprobs": [-0.1] * 2}
    got = run.compare([full, short], [short, full])
    assert got["identical"] == "0/2"
    assert got["first_divergence_per_prompt"] == [2, 2]
    # Control: equal outputs still count as identical.
    assert run.compare([full], [dict(full)])["identical"] == "1/1"


@pytest.mark.parametrize("sbo", [True, False])
def test_the_server_is_the_presets_decode_without_pd(tmp_path: Path, sbo: bool) -> None:
    topology = run.derived_topology(tmp_path)
    argv, env = run.server_command(topology, sbo, 31000)
    assert not any(a.startswith("--disaggregation") for a in argv)
    assert "--load-format" not in argv  # the written weights, not sglang's near-zero dummy ones
    assert ("--enable-single-batch-overlap" in argv) is sbo
    assert env["SGLANG_PD_SBO_MODE"] == ("full" if sbo else "off")
    assert env["SGLANG_SCHEDULER_SKIP_ALL_GATHER"] == "1"
    for flag, value in (("--moe-a2a-backend", "deepep"), ("--deepep-mode", "low_latency")):
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--port") + 1] == "31000"


def test_both_servers_take_one_small_share_of_memory_beside_the_pd_stack(tmp_path: Path) -> None:
    topology = run.derived_topology(tmp_path)
    sbo, _ = run.server_command(topology, True, 31000)
    nosbo, _ = run.server_command(topology, False, 33000)
    for argv in (sbo, nosbo):  # the same share, so that their step times compare
        assert argv.count("--mem-fraction-static") == 1
        assert argv[argv.index("--mem-fraction-static") + 1] == str(run.SERVER_MEM_FRACTION)
    # One server and the PD stack's two (the preset's own share each) fit one GPU.
    plan = yaml.safe_load(topology.read_text())
    stack = plan["prefill"]["mem_fraction_static"] + plan["decode"]["mem_fraction_static"]
    assert run.SERVER_MEM_FRACTION + stack <= 0.85


def test_servers_started_together_keep_their_nccl_port_ranges_apart() -> None:
    # sglang 0.5.17 draws a server's NCCL port from [port + 100, port + 1000]; the preset serves on 30000-30001.
    http = [*run.SERVER_PORTS.values(), 30000, 30001]
    for p in http:
        assert not [q for q in http if q in range(p + 100, p + 1001)]
    for p in run.SERVER_PORTS.values():
        for q in http:
            assert q == p or not set(range(p + 100, p + 1001)) & set(range(q + 100, q + 1001))


def test_prompts_fit_one_prefill_chunk() -> None:
    texts = run.prompts()
    assert len(texts) >= 8 and len(set(texts)) == len(texts)
    assert max(len(t.encode()) for t in texts) < 128  # the decode's chunked_prefill_size (one byte, one token)


def test_compare_counts_agreement_and_the_gap_where_tokens_agree() -> None:
    a = [
        {"status": 200, "ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]},
        {"status": 200, "ids": [4, 5, 6], "logprobs": [-1.0, -1.0, -1.0]},
        {"status": 500, "error": "x"},
    ]
    b = [
        {"status": 200, "ids": [1, 2, 3], "logprobs": [-0.1, -0.25, -0.3]},
        {"status": 200, "ids": [4, 9, 6], "logprobs": [-1.5, -9.0, -1.0]},
        {"status": 200, "ids": [7], "logprobs": [0.0]},
    ]
    got = run.compare(a, b)
    assert got["identical"] == "1/3"
    assert got["first_divergence_per_prompt"] == [None, 1, "error"]
    assert got["max_abs_logprob_diff_where_tokens_agree"] == pytest.approx(0.5)  # prompt 2, position 0 only


@pytest.mark.parametrize(
    ("stages", "message"),
    [("sbo,nosbo", "do not fit one GPU at once"), ("sbo,warm", "unknown stage(s) warm")],
)
def test_stage_lists_that_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stages: str, message: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_sbo_server.py", "--out", str(tmp_path), "--stages", stages, "--together"])
    with pytest.raises(SystemExit) as exit_:
        run.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before the report or any process


class _Events:
    """The order in which main() starts, awaits, measures and stops the stages (no process runs)."""

    #: Each stage's step time (ms): the client's and the GPU's; the server's decode lines say half.
    STEP_MS: ClassVar[dict[str, float]] = {"sbo": 2.0, "nosbo": 1.6, "sbo_again": 2.2}

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        not_ready: frozenset[str] = frozenset(),
        step_ms: dict[str, float] | None = None,
    ) -> None:
        self.log: list[tuple[str, str]] = []
        step_ms = step_ms or self.STEP_MS
        stack_log = self.log

        class Stack:
            def __init__(self, out: Path) -> None:
                self.out = out
                self.running: set[str] = set()

            def stop(self, name: str, *_: object, **__: object) -> None:
                if name in self.running:
                    self.running.discard(name)
                    stack_log.append(("stop", name))

            def stop_all(self) -> None:
                for name in sorted(self.running):
                    self.stop(name)

        def start_server(stack: Stack, topology: Path, name: str, gemm_fault: bool = False) -> dict[str, Any]:
            stack.running.add(name)
            self.log.append(("start", name))
            return {"started": 0.0}

        def start_pd(stack: Stack, topology: Path) -> dict[str, Any]:
            stack.running.add("up")
            self.log.append(("start", "pd"))
            return {"started": 0.0}

        def await_(stage: str, result: dict[str, Any]) -> None:
            if "not_ready" in result:
                raise RuntimeError(result["not_ready"])
            if "started" in result:
                self.log.append(("await", stage))
                if stage in not_ready:
                    raise run.gpu_pd_check.NotReady(f"{stage} exited with code 1 before it was ready")
                result.pop("started")

        def measure_server(stack: Stack, name: str, result: dict[str, Any], texts: list[str]) -> dict[str, Any]:
            await_(name, result)
            self.log.append(("measure", name))
            ms = step_ms[name]
            step = [{"batch": 1, "gpu_step_ms_p50": ms, "step_ms_p50": ms, "server_step_ms_p50": ms / 2}]
            forms = {form: [{"status": 200, "ids": [1, 2], "logprobs": [-0.1, -0.2]}] for form in run.REQUEST_FORMS}
            return dict(result, **forms, step_times=step)

        def measure_pd(stack: Stack, pd: dict[str, Any], texts: list[str]) -> dict[str, Any]:
            await_("pd", pd)
            self.log.append(("measure", "pd"))
            # Like the server's in every form but the first, which differs at position 1.
            forms = {form: [{"status": 200, "ids": [1, 2], "logprobs": [-0.1, -0.2]}] for form in run.REQUEST_FORMS}
            forms["outputs"] = [{"status": 200, "ids": [1, 3], "logprobs": [-0.1, -0.2]}]
            return dict(pd, **forms)

        monkeypatch.setattr(run, "Stack", Stack)
        monkeypatch.setattr(run, "start_server", start_server)
        monkeypatch.setattr(run, "start_pd", start_pd)
        monkeypatch.setattr(run, "await_server", lambda stack, name, result: await_(name, result))
        monkeypatch.setattr(run, "await_pd", lambda stack, pd: await_("pd", pd))
        monkeypatch.setattr(run, "measure_server", measure_server)
        monkeypatch.setattr(run, "measure_pd", measure_pd)
        monkeypatch.setattr(run.gpu_pd_check, "gpu_description", lambda: "test GPU")
        monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.17"))

    def run(self, monkeypatch: pytest.MonkeyPatch, out: Path, *args: str) -> tuple[int, dict[str, Any]]:
        argv = ["gpu_sbo_server.py", "--out", str(out), "--ref", str(out / "ref.json"), *args]
        monkeypatch.setattr(sys, "argv", argv)
        code = run.main()
        return code, json.loads((out / "report.json").read_text())


def test_together_starts_every_stage_and_waits_for_all_before_measuring_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _Events(monkeypatch)
    code, report = events.run(monkeypatch, tmp_path, "--stages", "pd,sbo", "--together")
    assert code == 0 and "errors" not in report
    # The stack stops before the SBO server is measured: its step times are taken with the GPU to itself.
    assert events.log == [
        ("start", "pd"), ("start", "sbo"), ("await", "pd"), ("await", "sbo"),
        ("measure", "pd"), ("stop", "up"), ("measure", "sbo"), ("stop", "sbo"),
    ]  # fmt: skip
    # Held to the SBO server although that was measured after the stack, in each form on its own.
    by_form = report["pd_vs_sbo_server"]
    assert list(by_form) == ["one at a time", "one at a time, again", "all at once"]
    assert by_form["one at a time"]["first_divergence_per_prompt"] == [1]
    assert by_form["one at a time, again"]["identical"] == by_form["all at once"]["identical"] == "1/1"


def test_a_later_call_compares_with_the_sbo_outputs_an_earlier_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _Events(monkeypatch).run(monkeypatch, first, "--stages", "sbo", "--ref", str(tmp_path / "ref.json"))
    code, report = _Events(monkeypatch).run(
        monkeypatch, second, "--stages", "nosbo,pd", "--ref", str(tmp_path / "ref.json")
    )
    assert code == 0
    assert report["sbo_vs_nosbo"]["identical"] == "1/1"
    assert report["step_time_ratio_sbo_over_nosbo"] == [
        {"batch": 1, "gpu_ratio": 1.25, "ratio": 1.25, "server_ratio": 1.25}
    ]
    assert report["pd_vs_sbo_server"]["one at a time"]["identical"] == "0/1"


def test_one_stage_at_a_time_without_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _Events(monkeypatch)
    code, report = events.run(monkeypatch, tmp_path, "--stages", "sbo,nosbo")
    assert code == 0
    assert events.log == [
        ("start", "sbo"), ("await", "sbo"), ("measure", "sbo"), ("stop", "sbo"),
        ("start", "nosbo"), ("await", "nosbo"), ("measure", "nosbo"), ("stop", "nosbo"),
    ]  # fmt: skip
    assert report["sbo_vs_nosbo"]["identical"] == "1/1"
    assert report["step_time_ratio_sbo_over_nosbo"] == [
        {"batch": 1, "gpu_ratio": 1.25, "ratio": 1.25, "server_ratio": 1.25}
    ]


def test_sbo_on_both_sides_of_nosbo_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _Events(monkeypatch)
    code, report = events.run(monkeypatch, tmp_path, "--stages", "sbo,nosbo,sbo")
    assert [e for e in events.log if e[0] == "measure"] == [
        ("measure", "sbo"), ("measure", "nosbo"), ("measure", "sbo_again"),
    ]  # fmt: skip
    both = {"gpu_ratio": 1.375, "ratio": 1.375, "server_ratio": 1.375}
    assert report["step_time_ratio_sbo_again_over_nosbo"] == [{"batch": 1, **both}]
    assert report["step_time_ratio_sbo_again_over_sbo"] == [
        {"batch": 1, "gpu_ratio": 1.1, "ratio": 1.1, "server_ratio": 1.1}
    ]
    # (2.0 + 2.2) / 2 over 1.6: 31 % slower, far past the 3 % allowed, and the run says so.
    assert code == 1
    assert report["sbo_step_time"]["per_batch"] == [
        {"batch": 1, "sbo_ms": 2.1, "nosbo_ms": 1.6, "sbo_over_nosbo": 1.3125, "sbo_again_over_sbo": 1.1}
    ]
    assert report["verdicts"]["sbo_step_time"] == (
        "SBO's GPU step time exceeds the server's without it by more than 3%: 1.312 at batch 1"
    )


@pytest.mark.parametrize(("sbo_again_ms", "passed"), [(2.04, True), (2.2, False)])
def test_the_step_time_verdict_takes_the_mean_of_sbo_on_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sbo_again_ms: float, passed: bool
) -> None:
    # On 1.98, off 2.0, on again 2.04 (mean 2.01, +0.5 %) passes; on again 2.2 (mean 2.09, +4.5 %) does not.
    events = _Events(monkeypatch, step_ms={"sbo": 1.98, "nosbo": 2.0, "sbo_again": sbo_again_ms})
    code, report = events.run(monkeypatch, tmp_path, "--stages", "sbo,nosbo,sbo")
    assert (code == 0) is passed
    assert (report["verdicts"]["sbo_step_time"] == "passed") is passed


def test_no_step_time_verdict_without_a_gpu_time_on_every_server() -> None:
    rows = [{"batch": 1, "gpu_step_ms_p50": 2.0}]
    got = run.step_time_verdict(rows, [{"batch": 1, "gpu_step_ms_p50": None}], rows)
    assert got["verdict"].startswith("no GPU step time at batch 1")


def test_the_server_step_time_comes_from_sglangs_decode_lines() -> None:
    # Lines as sglang 0.5.17 logged them on the H200: a plain server's, then a PD decode server's.
    log = (
        "[2026-12-03 14:10:02] Decode batch, #running-req: 1, #token: 0, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 400.00, #queue-req: 0\n"
        "[2026-12-03 14:10:03] Decode batch, #running-req: 4, #token: 64, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 2000.00, #queue-req: 0\n"
        "[2026-12-03 14:09:45] Decode batch, #running-req: 4, #token: 0, token usage: 0.00, pre-allocated usage: "
        "0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, cuda graph: True, gen throughput (token/s): "
        "1600.00, #queue-req: 0\n"
        "[2026-12-03 14:09:45] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 0, token usage: 0.00\n"
    )
    assert run.server_step_ms(log, 4) == [2.0, 2.5]  # 4 requests / 2000 tokens/s, 4 / 1600
    assert run.server_step_ms(log, 1) == [2.5]
    assert run.server_step_ms(log, 8) == []  # no line with that batch: no figure, rather than a wrong one


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "sbo,pd,sbo", "--together"], "not with --together"),
        (["--stages", "nosbo,sbo,nosbo"], "only sbo may run twice"),
        (["--stages", "sbo,sbo,sbo"], "only sbo may run twice"),
    ],
)
def test_repeats_other_than_one_more_sbo_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_sbo_server.py", "--out", str(tmp_path), *args])
    with pytest.raises(SystemExit) as exit_:
        run.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_stage_that_never_gets_ready_is_stopped_at_once_and_the_others_are_still_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _Events(monkeypatch, not_ready=frozenset({"sbo"}))
    code, report = events.run(monkeypatch, tmp_path, "--stages", "sbo,pd", "--together")
    assert code == 1
    assert events.log == [
        ("start", "sbo"), ("start", "pd"), ("await", "sbo"), ("stop", "sbo"), ("await", "pd"),
        ("measure", "pd"), ("stop", "up"),
    ]  # fmt: skip
    assert "sbo exited with code 1 before it was ready" in report["errors"]["sbo"]
    assert "pd_vs_sbo_server" not in report  # no SBO outputs to hold the stack to


def test_the_routers_generation_probes_are_counted_per_request_form() -> None:
    # Access lines as sglang 0.5.17 logged them on the H200 (decode-0.log of the PD stack).
    log = (
        '[2026-12-03 14:09:40] INFO:     127.0.0.1:47062 - "GET /health HTTP/1.1" 503 Service Unavailable\n'
        '[2026-12-03 14:09:44] INFO:     127.0.0.1:47088 - "GET /health HTTP/1.1" 200 OK\n'
        '[2026-12-03 14:09:46] INFO:     127.0.0.1:47110 - "GET /v1/models HTTP/1.1" 200 OK\n'
        '[2026-12-03 14:10:14] INFO:     127.0.0.1:47120 - "GET /health HTTP/1.1" 200 OK\n'
    )

    def at(stamp: str) -> float:
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))

    windows = {
        "outputs": (at("2026-12-03 14:09:40") + 0.5, at("2026-12-03 14:09:42") + 0.1),  # answered 1.9 s after
        "outputs_again": (at("2026-12-03 14:09:45") + 0.2, at("2026-12-03 14:09:50")),  # none: /v1/models is no probe
        "outputs_together": (at("2026-12-03 14:10:14") + 0.7, at("2026-12-03 14:10:16")),  # within its stamp's second
    }
    got = run.health_probes_during(log, windows)
    assert got == {"outputs": 1, "outputs_again": 0, "outputs_together": 1}  # the 503 generated nothing


def test_the_gpu_step_time_is_taken_at_the_batch_the_server_held() -> None:
    # 64 requests sent; sglang decoded 63 at once (the 64th waited), then the last one alone.
    rows = [(63, True, 2.2), (63, True, 2.4), (1, True, 1.7), (63, False, 9.0), (64, False, 9.0)]
    assert run.gpu_step_ms(rows, 64) == (63, [2.2, 2.4])
    assert run.gpu_step_ms(rows, 8) == (1, [1.7])
    assert run.gpu_step_ms([(4, False, 3.0)], 4) == (None, [])  # eager forwards are not the graphs compared
