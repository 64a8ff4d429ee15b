"""Faults under concurrent load with 2 prefill + 2 decode workers (real processes for SIGKILL, in
process otherwise): every request ends (completed or a clean error) within the timeout, the dead
worker is ejected, traffic continues on the others; a client disconnect aborts both legs; nothing
hangs."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.workers.breaker import BreakerState
from tests.support.polling import wait_until

from .conftest import FAST, Cluster, RouterLog, RunningRouter, serve_router
from .test_bad_input import assert_openai_error

# slow: over 8 s in all on 2 cores (`make quick` leaves it out); serial: its latency bounds hold on
# idle cores, so `make unit` runs it alone, after the parallel part.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

DEADLINE = 12.0  # every request must end well within this (request timeout is 10 s)
CHAT = "/v1/chat/completions"
TOKENS = 40


def _chat(stream: bool, rid: str, tokens: int = TOKENS) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"question {rid}"}], "max_tokens": tokens, "stream": stream}


STREAMING: set[str] = set()  # ids of streams that have received their first chunk


async def _stream(client: httpx.AsyncClient, url: str, rid: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    chunks: list[bytes] = []
    async with client.stream("POST", url + CHAT, json=_chat(True, rid), headers={"x-request-id": rid}) as resp:
        async for chunk in resp.aiter_raw():
            chunks.append(chunk)
            STREAMING.add(rid)
    return resp.status_code, b"".join(chunks), time.monotonic() - started


async def _unary(client: httpx.AsyncClient, url: str, rid: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    resp = await client.post(url + CHAT, json=_chat(False, rid), headers={"x-request-id": rid})
    return resp.status_code, resp.content, time.monotonic() - started


async def _load_with_fault(url: str, fault: Callable[[], None], when: Callable[[], bool], n: int = 12) -> list[Any]:
    """n streaming and n non-streaming requests at once; `fault()` runs as soon as `when()`."""
    STREAMING.clear()
    async with httpx.AsyncClient(timeout=DEADLINE + 5) as client:
        tasks = [asyncio.ensure_future(_stream(client, url, f"s{i}")) for i in range(n)]
        tasks += [asyncio.ensure_future(_unary(client, url, f"u{i}")) for i in range(n)]
        for _ in range(500):
            if when():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the fault's moment never came")
        await asyncio.to_thread(fault)
        return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE)


def _complete(body: bytes) -> bool:
    return len(re.findall(rb" tok\d+", body)) == TOKENS and b'"error"' not in body


def _wait_ejected(running: RunningRouter, role: str, url: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker = running.app.registry.get(url, role)  # type: ignore[arg-type]
        assert worker is not None
        if not worker.available(time.monotonic()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{role} worker {url} was not ejected: {worker.to_json()}")


def _traffic_continues(running: RunningRouter, live: list[Any]) -> None:
    before = sum(len(w.state()["requests"]) for w in live)
    with httpx.Client(timeout=10) as client:
        for i in range(16):
            resp = client.post(running.url + CHAT, json=_chat(i % 2 == 0, f"after{i}", tokens=2))
            assert resp.status_code == 200 and b'"error"' not in resp.content, resp.text
    assert sum(len(w.state()["requests"]) for w in live) - before == 16


def test_kill_decode_mid_stream(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(2, 2, processes=True, token_delay=0.015)
    victim, survivor = cluster.decodes
    with cluster.serve(cluster.config()) as running:
        # Kill it once most streams are flowing, so some are cut mid-stream.
        results = asyncio.run(_load_with_fault(running.url, victim.kill, when=lambda: len(STREAMING) >= 8))
        streams, unaries = results[:12], results[12:]
        for status, body, elapsed in streams:
            assert status == 200 and elapsed < DEADLINE
            assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
            # Completed, or a clean OpenAI-shaped error event naming the failure.
            assert _complete(body) or b'"code": "upstream_stream_error"' in body.replace(b'":"', b'": "')
        cut = [b for _, b, _ in streams if not _complete(b)]
        assert cut, "some streams were on the killed decode mid-stream"
        assert len(cut) < len(streams)
        for status, body, _ in unaries:
            # Nothing had reached these clients yet, so the router retried them on the survivor.
            assert status == 200 and _complete(body), body[:300]
        _wait_ejected(running, "decode", victim.url)
        _traffic_continues(running, [survivor])
        assert running.app.metrics.retries.labels("decode")._value.get() >= 1


def test_kill_prefill_retries_transparently(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(2, 2, processes=True, prefill_delay=0.4, token_delay=0.005)
    victim, survivor = cluster.prefills
    with cluster.serve(cluster.config()) as running:
        registry = running.app.registry
        # Kill it while it holds prefill legs whose decodes wait for the KV hand-off.
        busy = lambda: registry.get(victim.url, "prefill").in_flight >= 3  # type: ignore[union-attr]  # noqa: E731
        results = asyncio.run(_load_with_fault(running.url, victim.kill, when=busy))
        for status, body, elapsed in results:
            assert status == 200 and elapsed < DEADLINE, body[:300]
            assert _complete(body), body[-300:]
        _wait_ejected(running, "prefill", victim.url)
        # The decode legs of the failed attempts were aborted by the request ids they were sent.
        aborts = [a for d in cluster.decodes for a in d.state()["aborts"]]
        sent = {leg["rid"] for d in cluster.decodes for leg in d.state()["requests"]}
        assert aborts and all(a in sent for a in aborts)
        assert running.app.registry.get(survivor.url, "prefill").healthy  # type: ignore[union-attr]
        survivor.configure(prefill_delay=0)
        _traffic_continues(running, [survivor])


def _wait_aborts(workers: list[Any], rid: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(rid in w.state()["aborts"] for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError(f"abort_request for {rid} missing: {[w.state()['aborts'] for w in workers]}")


def _legs_of(cluster: Cluster, rid: str) -> list[Any]:
    """The prefill and the decode worker that received request `rid` (the router's id)."""
    return [w for w in cluster.prefills + cluster.decodes if any(r["rid"] == rid for r in w.state()["requests"])]


async def _hang_up(url: str, rid: str, stream: bool) -> None:
    """Send a request and disconnect: after the first chunk (stream) or after 0.15 s (unary)."""
    async with httpx.AsyncClient(timeout=10) as client:
        if stream:
            async with client.stream("POST", url + CHAT, json=_chat(True, rid, tokens=200),
                                     headers={"x-request-id": rid}) as resp:  # fmt: skip
                async for _ in resp.aiter_raw():
                    break
        else:
            with contextlib.suppress(httpx.ReadTimeout):
                await client.post(url + CHAT, json=_chat(False, rid, tokens=200), headers={"x-request-id": rid},
                                  timeout=0.15)  # fmt: skip


def test_client_disconnect_aborts_both_legs(cluster_factory: Callable[..., Cluster], router_log: RouterLog) -> None:
    cluster = cluster_factory(2, 2, token_delay=0.02, prefill_delay=0.05)
    with cluster.serve(cluster.config()) as running:

        async def scenario() -> list[Any]:
            async with httpx.AsyncClient(timeout=DEADLINE + 5) as client:
                load = [asyncio.ensure_future(_stream(client, running.url, f"bg-s{i}")) for i in range(6)]
                load += [asyncio.ensure_future(_unary(client, running.url, f"bg-u{i}")) for i in range(6)]
                await asyncio.gather(*[_hang_up(running.url, f"gone-{k}{i}", k == "s") for k in "su" for i in range(3)])
                return await asyncio.wait_for(asyncio.gather(*load), DEADLINE)

        background = asyncio.run(scenario())
        assert all(status == 200 and _complete(body) for status, body, _ in background), "others unaffected"
        for rid in [router_log.router_id(f"gone-{k}{i}") for k in "su" for i in range(3)]:
            legs = _legs_of(cluster, rid)
            assert len(legs) == 2, (rid, legs)
            _wait_aborts(legs, rid)
        wait_until(lambda: all(w.in_flight == 0 for w in running.app.registry.all()))


def test_hung_worker_times_out_cleanly(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, prefill_delay=30, handshake_timeout=30)
    with cluster.serve(cluster.config(request_timeout_s=1.0, max_retries=0)) as running:
        for stream in (False, True):
            started = time.monotonic()
            resp = httpx.post(
                running.url + CHAT, json=_chat(stream, "hang"), headers={"x-request-id": f"h{stream}"}, timeout=10
            )
            assert time.monotonic() - started < 3
            assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
            _wait_aborts([cluster.prefills[0], cluster.decodes[0]], resp.headers["x-router-request-id"])


def test_confirmed_5xx_trips_the_breaker_and_4xx_does_not(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 2)
    bad, good = cluster.decodes
    # A 5xx counts once a probe of the worker fails too; failed probes alone never eject here.
    with cluster.serve(cluster.config(breaker_failure_threshold=3, health_failure_threshold=100)) as running:
        bad.configure(fail_status=500, fail_count=100, models_status=503)
        with httpx.Client(timeout=10) as client:
            for i in range(8):
                resp = client.post(running.url + CHAT, json=_chat(i % 2 == 1, f"r{i}", tokens=2))
                assert resp.status_code == 200 and b'"error"' not in resp.content
        worker = running.app.registry.get(bad.url, "decode")
        assert worker is not None
        # The confirmation probes run in the background.
        wait_until(lambda: worker.breaker.state is BreakerState.OPEN)
        assert worker.healthy, "below the health threshold: the breaker alone ejected it"

        # 4xx from an engine goes back to the client and never trips the breaker.
        bad.configure(fail_count=0)
        good.configure(fail_status=400, fail_count=5)
        with httpx.Client(timeout=10) as client:
            for i in range(5):
                resp = client.post(running.url + CHAT, json=_chat(False, f"q{i}", tokens=2))
                assert resp.status_code == 400 and resp.json()["error"]["message"] == "injected failure"
        good_worker = running.app.registry.get(good.url, "decode")
        assert good_worker is not None and good_worker.breaker.state is BreakerState.CLOSED


def _refused_for_want_of(resp: httpx.Response, role: str) -> None:
    """A 503 in OpenAI's error shape with Retry-After, naming the missing role and GET /workers."""
    assert_openai_error(resp, 503, code="no_healthy_worker")
    assert resp.headers["content-type"] == "application/json"
    assert int(resp.headers["retry-after"]) >= 1
    message = resp.json()["error"]["message"]
    assert f"No healthy {role} worker" in message and "GET /workers" in message, message


def test_no_healthy_worker_is_503_with_retry_after_and_the_router_stays_ready(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # The router serves, and says so, also without a worker: a clear 503 beats refused connections.
    with serve_router(FAST) as running:
        for stream in (False, True):
            _refused_for_want_of(httpx.post(running.url + CHAT, json=_chat(stream, "n")), "prefill")
        ready = httpx.get(running.url + "/readiness")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "prefill": 0, "decode": 0}
        assert httpx.get(running.url + "/health").status_code == 200

    cluster = cluster_factory(1, 1)
    cluster.decodes[0].configure(health_status=503)  # never admitted
    with cluster.serve(cluster.config(), ready=False) as running:
        wait_until(lambda: httpx.get(running.url + "/readiness").json()["prefill"] == 1)
        for stream in (False, True):
            _refused_for_want_of(httpx.post(running.url + CHAT, json=_chat(stream, "m")), "decode")
        assert httpx.get(running.url + "/readiness").json() == {"status": "ready", "prefill": 1, "decode": 0}
