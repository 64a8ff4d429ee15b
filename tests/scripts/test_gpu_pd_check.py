"""The GPU check's wait for a PD stack, against a real router-shaped HTTP server and a real `up`-like
child: nothing is measured while `up` still runs its smoke request."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
check = importlib.import_module("gpu_pd_check")


class _Router(BaseHTTPRequestHandler):
    """GET /workers with one healthy prefill and decode, GET /readiness 200: a router that serves."""

    def do_GET(self) -> None:
        doc = (
            {"status": "ready"}
            if self.path == "/readiness"
            else {"prefill": [{"healthy": True}], "decode": [{"healthy": True}]}
        )
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return None


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(check, "ROUTER", url)
    yield url
    server.shutdown()
    server.server_close()


def _up(lines_then_sleep: str) -> list[str]:
    """A child that prints like `up` does, then stays (or exits)."""
    return [sys.executable, "-u", "-c", lines_then_sleep]


def test_the_stack_is_ready_only_once_up_has_finished_its_smoke_request(router: str, tmp_path: Path) -> None:
    stack = check.Stack(tmp_path)
    # The router has healthy workers from the start; `up` prints its smoke line and curl example later.
    script = (
        "import time\n"
        "print('ready in 1.0 s (sglang engine, topology single-h200-sbo)')\n"
        "time.sleep(1.5)\n"
        "print('smoke: chat completion ok in 176 ms (32 tokens); streamed ok in 1200 ms (6 chunks)')\n"
        f"print({check.UP_STARTED!r} + '-s http://127.0.0.1:8000/v1/chat/completions')\n"
        "time.sleep(60)\n"
    )
    stack.start("up", _up(script))
    try:
        got = check.wait_stack(stack, timeout_s=30)
        assert got["readiness"] == 200
        assert got["ready_s"] >= 1.5  # not at the router's first healthy answer
        assert "smoke: chat completion ok" in (tmp_path / "up.log").read_text()
    finally:
        stack.stop_all()


def test_an_up_that_exits_during_start_up_is_not_ready(router: str, tmp_path: Path) -> None:
    stack = check.Stack(tmp_path)
    script = "import sys\nprint('error: the stack is healthy, but its smoke request failed')\nsys.exit(4)\n"
    stack.start("up", _up(script))
    try:
        with pytest.raises(check.NotReady, match="`sglang-pd up` exited with code 4"):
            check.wait_stack(stack, timeout_s=30)
    finally:
        stack.stop_all()


class _Engines(BaseHTTPRequestHandler):
    """Stands in for the router and the two PD servers (sglang cannot run here): records each
    request, streams a completion a token a chunk, answers `/generate` with token ids that
    change, and log a fault, while the check's fault flag file exists (`fault_flag`, set per test)."""

    seen: list[dict[str, object]]
    fault_flag: Path | None = None
    fault_log: Path | None = None

    #: How many flushes each port refuses before it accepts one (sglang refuses while a request runs).
    busy: dict[str, int]
    #: The ports (by name) that end each completion at half its max_tokens.
    short: frozenset[str] = frozenset()

    def do_POST(self) -> None:
        if self.path == "/flush_cache":
            name = type(self).ports[self.server.server_address[1]]  # type: ignore[attr-defined]
            type(self).seen.append({"path": self.path, "to": name})
            refuse = type(self).busy.get(name, 0) > 0
            if refuse:
                type(self).busy[name] -= 1
            self.send_response(400 if refuse else 200)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append({"path": self.path, "port": self.server.server_address[1], **body})
        if self.path == "/generate":
            faulty = self.fault_flag is not None and self.fault_flag.exists()
            if faulty and self.fault_log is not None:
                with self.fault_log.open("a") as f:
                    f.write(json.dumps({"event": "fault", "pid": 1}) + "\n")
            ids = [99 if faulty else len(body["text"]) % 7] * check.MAX_NEW_TOKENS
            payload = json.dumps({"text": "", "output_ids": ids}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        # A completion as sglang's serving_completions.py answers it: one chunk per token, then the
        # usage chunk when `stream_options.include_usage` asks for it; unary, the usage beside the choices.
        name = type(self).ports[self.server.server_address[1]]  # type: ignore[attr-defined]
        tokens = int(body.get("max_tokens", 16)) // (2 if name in type(self).short else 1)
        usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
        self.send_response(200)
        self.end_headers()
        if body.get("stream"):
            for i in range(tokens):
                self.wfile.write(f'data: {{"choices": [{{"index": 0, "text": "{i % 10}"}}]}}\n\n'.encode())
            if (body.get("stream_options") or {}).get("include_usage"):
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            self.wfile.write(json.dumps({"choices": [{"index": 0, "text": "0" * tokens}], "usage": usage}).encode())

    #: Seconds each completion a server answered adds to a stage of its histograms.
    STAGE_SECONDS: ClassVar[dict[str, dict[str, float]]] = {
        "prefill": {"prefill_forward": 0.010},
        "decode": {"decode_waiting": 0.004},
    }

    def do_GET(self) -> None:
        """/metrics as sglang's prometheus_client writes its stage histograms (engine_stages.py):
        sums and counts that grow with each completion this server answered, beside buckets."""
        port = self.server.server_address[1]
        name = type(self).ports[port]  # type: ignore[attr-defined]
        n = sum(r.get("path") == "/v1/completions" and r.get("port") == port for r in type(self).seen)
        labels = f'engine_type="{name}",model_name="tiny-deepseek-v3",tp_rank="0"'
        lines = []
        for stage, seconds in self.STAGE_SECONDS.get(name, {}).items():
            series = f'{{{labels},stage="{stage}"}}'
            lines += [f"sglang:per_stage_req_latency_seconds_sum{series} {seconds * n}"]
            lines += [f"sglang:per_stage_req_latency_seconds_count{series} {float(n)}"]
            lines += [f'sglang:per_stage_req_latency_seconds_bucket{{{labels},le="+Inf",stage="{stage}"}} {float(n)}']
        payload = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        return None


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Engines]]:
    handler = type("Engines", (_Engines,), {"seen": [], "busy": {}})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    router, prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    monkeypatch.setattr(check, "ROUTER", router)
    monkeypatch.setattr(check, "PREFILL", prefill)
    monkeypatch.setattr(check, "DECODE", decode)
    handler.ports = {
        s.server_address[1]: name for s, name in zip(servers, ("router", "prefill", "decode"), strict=True)
    }  # type: ignore[attr-defined]
    yield handler
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("stream", [True, False])
def test_the_router_comparison_rotates_its_arms_with_prompts_of_their_own(
    engines: type[_Engines], stream: bool
) -> None:
    # The prefill's port stands in for smg here: a third server, measured like the router.
    arms = {"router": check.ROUTER, "smg": check.PREFILL, "direct": None}
    got = check.routers_compared(1, arms, stream=stream, rounds=3)
    mode = "stream" if stream else "unary"
    ports = engines.ports  # type: ignore[attr-defined]
    tagged = [r for r in engines.seen if str(r.get("prompt", " ")).split()[1:2] in (["router"], ["smg"], ["direct"])]
    # The direct arm's prefill leg (drained in the background) is not a request of its own.
    drains = [r for r in tagged if ports[r["port"]] == "prefill" and str(r["prompt"]).split()[1] == "direct"]
    sent = [r for r in tagged if r not in drains]
    arm_of = {id(r): str(r["prompt"]).split()[1] for r in sent}
    tags = [" ".join(str(r["prompt"]).split()[1:3]) for r in sent]
    runs = [t for i, t in enumerate(tags) if i == 0 or tags[i - 1] != t]
    # Each round starts one arm later: no arm always goes first.
    assert runs == [
        "router r0",
        "smg r0",
        "direct r0",
        "smg r1",
        "direct r1",
        "router r1",
        "direct r2",
        "router r2",
        "smg r2",
    ]
    for arm, where in (("router", "router"), ("smg", "prefill"), ("direct", "decode")):
        assert {ports[r["port"]] for r in sent if arm_of[id(r)] == arm} == {where}
    assert sorted(str(r["prompt"]) for r in drains) == sorted(
        str(r["prompt"]) for r in sent if arm_of[id(r)] == "direct"
    )
    assert all(f" {mode} " in str(r["prompt"]) for r in sent)
    # No two requests share their first KV page (16 tokens, a character each): no arm reads another's prefix.
    per_round = check.latency_requests(1)
    assert len({str(r["prompt"])[:16] for r in sent}) == len(sent) == 3 * 3 * per_round
    assert all(got["arms"][arm]["requests"] == 3 * per_round for arm in arms)
    assert set(got["adds_over_direct_ms"]) == {"router", "smg"} and len(got["adds_over_direct_ms"]["smg"]) == 3
    timed = "ttft_p50_ms" if stream else "e2e_p50_ms"
    assert got["arms"]["router"][timed] is not None and got["arms"]["router"]["statuses"] == {"200": 3 * per_round}
    assert (got["arms"]["router"]["ttft_p50_ms"] is None) is not stream  # unary has no first token to time
    # The table divides ours by smg's, per cell, and keeps the spread of what each adds over direct.
    (row,) = check.router_table([got])
    lat = "ttft" if stream else "e2e"
    ours, theirs = got["arms"]["router"], got["arms"]["smg"]
    assert row["router_over_smg"]["p99"] == ours[f"{lat}_p99_ms"] / theirs[f"{lat}_p99_ms"]
    assert row["router_over_smg"]["tok_per_s"] == ours["output_tok_per_s"] / theirs["output_tok_per_s"]
    adds = sorted(got["adds_over_direct_ms"]["router"])
    assert row["router_adds_ms"] == {"median": adds[1], "min": adds[0], "max": adds[2]}
    # Every answer was whole: its reported tokens, not max_tokens assumed, make the rate.
    assert all(got["arms"][arm]["short_answers"] == 0 for arm in arms)
    assert check.whole_answers([got]) is None
    if stream:
        assert all(r.get("stream_options") == {"include_usage": True} for r in sent)


def test_the_usage_chunk_is_not_timed_as_a_token(engines: type[_Engines]) -> None:
    got = asyncio.run(check.latency_samples(check.ROUTER, 1, 2, "usage", stream=True, max_tokens=16))
    # Two answers of 16 token chunks each, then their usage chunks: one first token and 15 gaps each.
    assert (len(got["ttft"]), len(got["itl"]), got["tokens"], got["short"]) == (2, 2 * 15, 32, 0)


def test_each_arm_is_told_where_its_requests_spent_their_time_on_each_engine(engines: type[_Engines]) -> None:
    # The stand-ins' histograms grow only with the completions each answered: the router's arm
    # reaches neither engine here, smg's (the prefill's port) only the prefill, direct's both.
    arms = {"router": check.ROUTER, "smg": check.PREFILL, "direct": None}
    got = check.routers_compared(
        1, arms, stream=False, rounds=2, engines={"prefill": check.PREFILL, "decode": check.DECODE}
    )
    n = 2 * check.latency_requests(1)
    forward = {"prefill_forward": {"mean_ms": 10.0, "count": n}}
    assert got["engine_stages"] == {
        "router": {"requests": n, "prefill": {}, "decode": {}},
        "smg": {"requests": n, "prefill": forward, "decode": {}},
        "direct": {"requests": n, "prefill": forward, "decode": {"decode_waiting": {"mean_ms": 4.0, "count": n}}},
    }


@pytest.mark.parametrize("stream", [True, False])
def test_an_arm_that_cuts_answers_short_makes_the_comparison_fail(engines: type[_Engines], stream: bool) -> None:
    # The prefill's port stands in for smg; it ends every completion at half its max_tokens.
    engines.short = frozenset({"prefill"})
    arms = {"router": check.ROUTER, "smg": check.PREFILL, "direct": None}
    got = check.routers_compared(1, arms, stream=stream, rounds=1)
    assert got["arms"]["smg"]["short_answers"] == check.latency_requests(1)
    assert got["arms"]["router"]["short_answers"] == got["arms"]["direct"]["short_answers"] == 0
    # The rate counts what came back: half the tokens, not max_tokens assumed.
    n = check.latency_requests(1)
    assert got["arms"]["smg"]["output_tokens"] == n * 32 and got["arms"]["router"]["output_tokens"] == n * 64
    why = check.whole_answers([got])
    assert why is not None and "smg" in why and "router" not in why, why


def test_quantiles_interpolate_and_say_none_without_samples() -> None:
    assert check._quantile([], 0.5) is None
    assert check._quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert check._quantile([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_the_fault_control_turns_the_fault_on_only_for_its_prompts(engines: type[_Engines], tmp_path: Path) -> None:
    env = check.fault_env(tmp_path)
    engines.fault_flag, engines.fault_log = Path(env[check.FAULT_FLAG_ENV]), Path(env[check.FAULT_LOG_ENV])
    controls = check.control_prompts()
    ref = asyncio.run(check.generate_all(check.ROUTER, controls, []))  # flag absent: the clean outputs
    got = check.fault_control(env, ref)
    assert got["verdict"] == "passed" and len(got["faults"]) == len(controls)
    assert all(c["pd_with_fault"] == [99] * check.MAX_NEW_TOKENS for c in got["controls"])
    assert [c["pd_without_fault"] for c in got["controls"]] == [r["ids"] for r in ref]
    assert not engines.fault_flag.exists()  # off again for what follows
    # Control: a stack where the fault does not reach the KV send answers as the reference does.
    engines.fault_flag = None
    failed = check.fault_control(env, ref)
    assert "no fault" in failed["verdict"]


def test_compared_requests_go_one_at_a_time_each_after_the_caches_are_emptied(engines: type[_Engines]) -> None:
    controls = check.control_prompts()
    engines.busy["prefill"] = 2  # refused twice (a request still running), then emptied
    got = asyncio.run(check.generate_all(check.ROUTER, controls, check.pd_caches()))
    assert [g["status"] for g in got] == [200] * len(controls)
    order = [s.get("to") or s["path"] for s in engines.seen]
    # Per prompt: the prefill's cache (retried until emptied), the decode's, then the request alone.
    first = ["prefill", "prefill", "prefill", "decode", "/generate"]
    assert order == first + ["prefill", "decode", "/generate"] * (len(controls) - 1)


def test_a_cache_that_cannot_be_emptied_stops_the_comparison(engines: type[_Engines]) -> None:
    # Control: the prefill never empties its cache, so no compared request may be sent.
    engines.busy["prefill"] = 10**6
    with pytest.raises(RuntimeError, match="flush_cache answered 400"):
        asyncio.run(check.generate_all(check.ROUTER, check.control_prompts(), check.pd_caches()))
    assert not [s for s in engines.seen if s["path"] == "/generate"]
    # The decode's flush is tried, not required: a decode that refuses it is compared all the same.
    engines.busy = {"decode": 10**6}
    got = asyncio.run(check.generate_all(check.ROUTER, check.control_prompts()[:1], check.pd_caches()))
    assert got[0]["status"] == 200


def test_a_failed_requirement_fails_the_run() -> None:
    report: dict[str, object] = {}
    check.verdict(report, "identity", None)
    assert report == {"verdicts": {"identity": "passed"}}
    check.verdict(report, "fault_control", "fault control: control 0 gave the single server's 32 tokens")
    assert report["failures"] == ["fault control: control 0 gave the single server's 32 tokens"]


def test_a_later_pd_call_uses_the_single_outputs_of_the_same_commit_and_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "ref.json"
    first = {"commit": "abc", "model": {"weights_sha256": "f" * 64}, "single": {"ready_s": 1.0}}
    ref = {"forms": {"generate": [{"status": 200, "ids": [1, 2]}]}}
    check.save_reference(path, first, ref)
    later: dict[str, object] = {"commit": "abc", "model": {"weights_sha256": "f" * 64}}
    assert check.load_reference(path, later) == ref
    assert later["single"] == {"ready_s": 1.0}
    # Control: another commit's (or other weights') outputs are no reference for this one.
    other: dict[str, object] = {"commit": "abd", "model": {"weights_sha256": "f" * 64}}
    assert check.load_reference(path, other) is None
    assert "abc" in str(other["reference_refused"])
    assert check.load_reference(tmp_path / "none.json", later) is None


def test_an_unknown_stage_is_refused_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_pd_check.py", "--out", str(out), "--stages", "single,migrate"])
    assert check.main() == 2
    assert not out.exists()  # refused before the tree check, the model or a server


def test_a_committed_reports_single_outputs_are_taken_only_for_the_same_weights_and_gpu(tmp_path: Path) -> None:
    kept = json.loads((check.REPO / "benchmarks/results/gpu_pd_h100_2026-12-06_34facdb.json").read_text())
    path = tmp_path / "kept.json"
    path.write_text(json.dumps(kept))
    same = {"model": {"weights_sha256": kept["model"]["weights_sha256"]}, "gpu": "NVIDIA H100 80GB HBM3, 999.1, 1 MiB"}
    ref = check.reference_from_report(path, same)
    assert ref is not None and same["single_from"].startswith(f"{path} (commit 34facdb")
    assert ref["forms"]["generate"][0]["ids"] == kept["single"]["forms"]["generate"][0]["ids"]
    assert [c["ids"] for c in ref["controls"]] == [c["single"] for c in kept["pd"]["fault_control"]["controls"]]
    # The verdicts read these rows as they read a live single server's.
    assert check.pd_verdicts.compare_form(ref["forms"]["chat"], ref["forms"]["chat"], check.MAX_NEW_TOKENS)[
        "all_identical"
    ]
    for other in (
        {"model": {"weights_sha256": "0" * 64}, "gpu": same["gpu"]},
        {"model": same["model"], "gpu": "NVIDIA H200, 580.159.04, 143771 MiB"},
    ):
        assert check.reference_from_report(path, other) is None and "reference_refused" in other


def test_an_attack_fails_the_admission_verdict_when_victims_fail_or_wait_or_take_over_a_second() -> None:
    bench = importlib.import_module("benchmarks.bench_overload")
    ok = {
        "attack": "starvation",
        "victims": {"outcomes": {"200": 1726}},
        "victim_p99_s": 0.449,
        "victim_admission_wait_p99_s": 0.0,
        "victims_ok": True,
        "victims_end_to_end_ok": True,
    }
    assert check.admission_failure(ok) is None
    slow = {**ok, "victim_p99_s": 5.911, "victims_end_to_end_ok": False}
    assert "end-to-end p99 5.911 s" in str(check.admission_failure(slow))
    refused = {**ok, "victims": {"outcomes": {"200": 40, "429": 2}}, "victims_ok": False}
    assert "'429': 2" in str(check.admission_failure(refused))
    # The bound the row's flags come from is the benchmark's own.
    assert bench.VICTIM_P99_BOUND_S == 1.0


def test_the_reserve_router_is_the_stacks_router_on_another_port_with_the_reserve() -> None:
    import argparse
    import dataclasses

    from sglang_pd.deploy.ops.up import _router_child
    from sglang_pd.deploy.router.cli import add_arguments, build_config
    from sglang_pd.deploy.spec.topology import load_topology

    topology = load_topology(check.TOPOLOGY)
    ups = _router_child(topology, "127.0.0.1", 8000).argv  # what `up` starts, as /proc shows it
    argv = check.reserve_router_argv(ups, check.RESERVE_ROUTER_PORT, check.ADMISSION_RESERVE)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config, _ = build_config(parser.parse_args(argv[4:]), environ={})
    ours, _ = build_config(parser.parse_args(ups[4:]), environ={})
    assert argv[:4] == ups[:4] == [sys.executable, "-m", "sglang_pd.deploy.cli", "router"]
    assert (config.port, config.client_reserve, ours.port, ours.client_reserve) == (8301, 0.125, 8000, 0.0)
    assert dataclasses.replace(config, port=8000, client_reserve=0.0) == ours  # alike but for port and reserve
    assert topology.decode.max_running_requests * check.ADMISSION_RESERVE >= 1  # at least one slot is kept
    with pytest.raises(RuntimeError, match="no --port"):
        check.reserve_router_argv(ups[:6], 8301, 0.125)
