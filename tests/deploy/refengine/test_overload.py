"""More requests than the engines run, through the real router: they wait in the router (not in a
queue no one can see), a full router queue answers 429 and a full engine 503, both with
Retry-After and never 502, and every bootstrap room and reservation is released."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.ops.up import local_children
from sglang_pd.deploy.refengine.scheduler import ENV_MAX_QUEUED_REQUESTS
from sglang_pd.deploy.spec.topology import load_checked_topology
from tests.support.polling import wait_until

from ..ops.test_up import _topology
from .conftest import Proc, launcher

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

Outcome = tuple[int, str, str | None]  # status, the error body or the finish reason, Retry-After


def _stream(router: Proc, tokens: int, out: list[Outcome]) -> None:
    """One streamed /generate of exactly `tokens` tokens; appends its `Outcome`."""
    body = {"text": "Tell me a story", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", f"{router.url}/generate", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            out.append((resp.status_code, resp.read().decode(), resp.headers.get("retry-after")))
            return
        last: dict[str, Any] = {}
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
        out.append((200, json.dumps(last["meta_info"]["finish_reason"]), None))


def _capacity(router: Proc, role: str) -> dict[str, Any]:
    workers = httpx.get(f"{router.url}/workers", timeout=5).json()
    (worker,) = workers[role]
    return dict(worker["capacity"])


def _all_healthy(router: Proc) -> bool:
    workers = httpx.get(f"{router.url}/workers", timeout=5).json()
    return all(w["healthy"] for w in workers["prefill"] + workers["decode"])


def test_requests_beyond_the_engines_capacity_wait_in_the_router_and_all_succeed(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", args=["--max-running-requests", "2"])
        decode = lx.engine("decode", args=["--max-running-requests", "2"])
        router = lx.router(prefill, decode)
        lx.wait()
        assert _capacity(router, "decode")["max_running_requests"] == 2  # read from /server_info
        results: list[Outcome] = []
        threads = [threading.Thread(target=_stream, args=(router, 24, results)) for _ in range(8)]
        for t in threads:
            t.start()
        most_admitted = most_waiting = 0
        while any(t.is_alive() for t in threads):
            most_admitted = max(most_admitted, _capacity(router, "decode")["admitted"])
            most_waiting = max(most_waiting, int(router.metric("sglang_pd_router_capacity_queue_depth")))
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert [status for status, _, _ in results] == [200] * 8, results
        assert all('"length"' in how for _, how, _ in results), results
        assert 0 < most_admitted <= 2 and most_waiting > 0, (most_admitted, most_waiting)
        # The router releases a stream's reservation as its handler unwinds, just after the client's
        # last byte: waited for, not read at once.
        wait_until(lambda: all(_capacity(router, role)["admitted"] == 0 for role in ("decode", "prefill")))
        assert prefill.metric("sglang_pd_refengine_bootstrap_rooms") == 0


def test_a_full_router_queue_answers_429_with_retry_after(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", args=["--max-running-requests", "2"])
        decode = lx.engine("decode", args=["--max-running-requests", "2"])
        router = lx.router(prefill, decode, args=["--max-queued-requests", "1", "--queue-timeout", "2"])
        lx.wait()
        long: list[Outcome] = []
        # The holders must outlast the waiter's 0.5 s + 2 s: at the tiny model's ~270 tokens/s on a quiet
        # 2-core machine, 400 tokens lasted about 1.5 s and the waiter was admitted. The abort below ends them.
        holders = [threading.Thread(target=_stream, args=(router, 3000, long)) for _ in range(2)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 30
        while _capacity(router, "decode")["admitted"] < 2:
            assert time.monotonic() < deadline, _capacity(router, "decode")
            time.sleep(0.05)
        waited: list[Outcome] = []
        waiter = threading.Thread(target=_stream, args=(router, 4, waited))
        waiter.start()
        time.sleep(0.5)  # it waits in the router's queue
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        full = httpx.post(f"{router.url}/generate", json=body, timeout=30)
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1, full.text
        assert full.json()["error"]["code"] == "capacity_queue_full"
        t0 = time.monotonic()
        waiter.join(30)
        assert waited and waited[0][0] == 429 and "capacity_queue_timeout" in waited[0][1] and waited[0][2], waited
        assert time.monotonic() - t0 < 2.5  # the queue timeout is 2 s from its arrival
        httpx.post(f"{decode.url}/abort_request", json={"rid": ""}, timeout=10)  # end the holders
        for t in holders:
            t.join(60)
        deadline = time.monotonic() + 10
        while prefill.metric("sglang_pd_refengine_bootstrap_rooms") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prefill.metric("sglang_pd_refengine_bootstrap_rooms") == 0
        wait_until(lambda: _capacity(router, "decode")["admitted"] == 0)


def test_an_engine_that_answers_queue_full_is_a_503_with_retry_after_not_a_worker_failure(tmp_path: Path) -> None:
    # sglang refuses for load only when it serves alone with --max-queued-requests (PD roles ignore
    # it): two such engines, one running slot each and no queue. Each router keeps within what the
    # engines report, but two routers (replicas) in front of them count only their own requests.
    env = {ENV_MAX_QUEUED_REQUESTS: "0"}
    with launcher(tmp_path) as lx:
        one = lx.engine("both", env=env, args=["--max-running-requests", "1"], name="one")
        two = lx.engine("both", env=env, args=["--max-running-requests", "1"], name="two")
        routers = [lx.router(one, two), lx.router(one, two)]
        lx.wait(one, two)
        lx.wait(*routers)
        # A router is ready with one healthy pair; this case needs each to see both engines, or both
        # requests go to the one it sees (an engine that started late on a loaded machine).
        for router in routers:
            wait_until(lambda router=router: _all_healthy(router), timeout=60)
        results: list[Outcome] = []
        threads = [threading.Thread(target=_stream, args=(router, 60, results)) for router in routers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 2 and {status for status, _, _ in results} <= {200, 503}, results
        refusals = [(json.loads(text), retry) for status, text, retry in results if status == 503]
        assert refusals, f"one engine had two requests for its one slot: {results}"
        for body, retry in refusals:
            assert body["error"]["code"] == "worker_busy" and retry is not None, (body, retry)
        for router in routers:
            workers = httpx.get(f"{router.url}/workers", timeout=5).json()
            assert all(w["breaker"] == "closed" and w["healthy"] for w in workers["prefill"] + workers["decode"])
            errors = {k: v for k, v in router.metrics().items() if k.startswith("sglang_pd_router_upstream_errors")}
            assert all('kind="busy"' in k for k, v in errors.items() if v), errors


def test_the_topologys_context_length_reaches_the_engines_and_the_router_enforces_it(tmp_path: Path) -> None:
    # `up` renders the topology's context_length as the engines' --context-length, as `launch` does
    # for sglang; the router reads it from /server_info and refuses a larger token limit itself.
    topo, _ = _topology(tmp_path)
    t, _ = load_checked_topology(str(topo))
    assert t.model.context_length == 4096
    specs = {s.name: s for s in local_children(t, host="127.0.0.1", port=28400)}
    for name in ("prefill-0", "decode-0"):
        argv = specs[name].argv
        assert argv[argv.index("--context-length") + 1] == "4096", argv
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", args=["--context-length", "512"])
        decode = lx.engine("decode", args=["--context-length", "512"])
        router = lx.router(prefill, decode)
        lx.wait()
        assert _capacity(router, "decode")["context_length"] == 512
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
        too_long = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=30)
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()["error"]
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
        assert "512" in error["message"]  # the router's words: the engine's are "max_completion_tokens is too large"
        chat["max_tokens"] = 4
        assert httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
