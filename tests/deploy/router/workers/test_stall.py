"""P/D health coupling when a worker freezes or its streams wait: a SIGSTOPped worker process is
ejected within failure_threshold x interval + timeout by its liveness probes, or sooner by the
stall watchdog when its open streams go quiet, and readmitted by its next passing generation
probe; streams waiting for their first byte behind a long prefill, or on a slow client, never
count as a stall."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.config import RouterConfig
from sglang_pd.deploy.router.metrics import RouterMetrics
from sglang_pd.deploy.router.pd.legs import PairStreamOutcome
from sglang_pd.deploy.router.workers.breaker import BreakerState
from sglang_pd.deploy.router.workers.health import HealthChecker
from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from tests.support.polling import wait_until

from ..conftest import Cluster, RunningRouter

# slow: over 8 s in all on 2 cores (`make quick` leaves it out); serial: its latency bounds hold on
# idle cores, so `make unit` runs it alone, after the parallel part.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

CHAT = "/v1/chat/completions"
SGLANG_TICK_S = 1.0  # the test workers' default: sglang's /health looks once a second


@contextlib.contextmanager
def frozen(worker: Any) -> Iterator[float]:
    """SIGSTOP the worker's process; yields when it was stopped; SIGCONT on the way out."""
    pid = worker.child.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


def _healthy(running: RunningRouter, url: str) -> bool:
    worker = running.app.registry.get(url, "decode")
    assert worker is not None
    return worker.healthy


def _healthy_decodes(running: RunningRouter) -> int:
    return int(httpx.get(running.url + "/readiness").json()["decode"])


def test_a_frozen_decode_is_ejected_by_its_liveness_probes_and_readmitted(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # Workers with sglang's /health timing; the router probes faster than its defaults (bound 11 s)
    # to keep the test short.
    cluster = cluster_factory(1, 2, processes=True, health_tick_s=SGLANG_TICK_S)
    frozen_worker, other = cluster.decodes
    interval, timeout, threshold = 0.5, 1.0, 3
    bound = threshold * interval + timeout  # every probe started after the freeze times out
    config = cluster.config(health_interval_s=interval, health_timeout_s=timeout, health_failure_threshold=threshold)
    with cluster.serve(config) as running, httpx.Client(timeout=10) as client:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        worker = running.app.registry.get(frozen_worker.url, "decode")
        assert worker is not None
        worker.breaker.record_failure()  # a half-counted breaker must not delay the readmission
        with frozen(frozen_worker) as stopped:
            wait_until(lambda: not _healthy(running, frozen_worker.url), timeout=bound + 5)
            ejected_after = time.monotonic() - stopped
            assert ejected_after <= bound + 0.5, (ejected_after, bound)  # 0.5 s for a busy machine
            assert worker.consecutive_health_failures >= threshold
            for _ in range(5):  # the rest of the cluster serves at once
                started = time.monotonic()
                assert client.post(running.url + CHAT, json=body).status_code == 200
                assert time.monotonic() - started < 1.0
            assert client.get(running.url + "/readiness").status_code == 200
            assert _healthy_decodes(running) == 1
        resumed = time.monotonic()
        wait_until(lambda: _healthy(running, frozen_worker.url), timeout=10)
        readmitted_after = time.monotonic() - resumed
        # The generation probe sent while it was frozen (or the next one) passes a tick later.
        assert readmitted_after <= interval + SGLANG_TICK_S + 0.5, readmitted_after
        assert worker.breaker.state is BreakerState.CLOSED
        other.configure(fail_status=503, fail_count=1000)  # the readmitted worker takes the traffic
        for _ in range(3):
            assert client.post(running.url + CHAT, json=body).status_code == 200


def test_stalled_stream_ejects_the_decode_and_readiness_counts_it(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, processes=True)
    decode = cluster.decodes[0]
    decode.configure(token_delay=0.05)
    # Probes are rare here: only the stall watchdog can eject the worker within the test.
    config = cluster.config(health_interval_s=60.0, stream_stall_s=0.5)
    with cluster.serve(config) as running, httpx.Client(timeout=30) as client:
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "stream": True}
            with contextlib.suppress(httpx.HTTPError), client.stream("POST", running.url + CHAT, json=body) as resp:
                for _ in resp.iter_raw():
                    first_chunk.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_chunk.wait(10)
        with frozen(decode) as stopped:
            wait_until(lambda: not _healthy(running, decode.url), timeout=3.0)
            assert time.monotonic() - stopped <= 2.0
            ready = client.get(running.url + "/readiness")
            assert ready.status_code == 200 and ready.json()["decode"] == 0
            started = time.monotonic()
            resp = client.post(running.url + CHAT, json={"messages": [{"role": "user", "content": "y"}]})
            assert resp.status_code == 503 and time.monotonic() - started < 1.0, "refused, not left waiting"
        reader.join(timeout=20)


BACKLOG_S = 30.0


def test_a_30s_prefill_backlog_never_ejects_a_healthy_decode(cluster_factory: Callable[..., Cluster]) -> None:
    # Streams queued behind a slow prefill wait 30 s for their first byte (their first token)
    # while streams through the other prefill flow on the same decode, with the default stall.
    cluster = cluster_factory(2, 1, token_delay=0.05, handshake_timeout=BACKLOG_S * 2)
    slow = cluster.prefills[0]
    slow.configure(prefill_delay=BACKLOG_S)
    config = cluster.config(prefill_policy="least_load", request_timeout_s=120.0, stream_idle_timeout_s=120.0)
    assert config.stream_stall_s == RouterConfig().stream_stall_s
    with cluster.serve(config) as running:
        decode = running.app.registry.decode[0]
        ejected = threading.Event()

        def watch() -> None:
            while not ejected.is_set() and not done.is_set():
                if not decode.healthy:
                    ejected.set()
                time.sleep(0.02)

        async def stream(client: httpx.AsyncClient, rid: str, tokens: int) -> tuple[int, int, float]:
            body = {"messages": [{"role": "user", "content": rid}], "max_tokens": tokens, "stream": True}
            started, first = time.monotonic(), math.inf
            chunks = []
            async with client.stream("POST", running.url + CHAT, json=body, headers={"x-request-id": rid}) as resp:
                async for chunk in resp.aiter_raw():
                    first = min(first, time.monotonic() - started)
                    chunks.append(chunk)
            return resp.status_code, len(re.findall(rb" tok\d+", b"".join(chunks))), first

        async def scenario() -> tuple[list[Any], list[Any]]:
            async with httpx.AsyncClient(timeout=BACKLOG_S * 3) as client:
                # Least load with ties rotating: of two requests at once, one lands on each prefill.
                queued = [asyncio.ensure_future(stream(client, f"queued{i}", 20)) for i in range(2)]
                await asyncio.sleep(0.5)
                flowing = []
                while slow.in_flight:  # the slow prefill is busy: these take the other one
                    flowing.append(await stream(client, f"flow{len(flowing)}", 20))
                return list(await asyncio.gather(*queued)), flowing

        done = threading.Event()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            queued, flowing = asyncio.run(scenario())
        finally:
            done.set()
            watcher.join()
        assert not ejected.is_set(), decode.last_error
        assert all(status == 200 and tokens == 20 for status, tokens, _ in queued + flowing), (queued, flowing)
        assert max(first for _, _, first in queued) >= BACKLOG_S, "one stream waited out the backlog"
        assert len(slow.state()["requests"]) == 1 and len(flowing) > 10


# -- the watchdog's rules, on their own -------------------------------------------------------------

STALL_S = 0.4


def _watched_decode() -> tuple[HealthChecker, Worker]:
    """A healthy decode under a watchdog that probes nothing (it reports, as a serving process's)."""
    registry = WorkerRegistry()
    worker = registry.add("http://decode-0:1", "decode", healthy=True)
    checker = HealthChecker(
        registry, RouterMetrics(), None, interval_s=60, failure_threshold=1, success_threshold=1,  # type: ignore[arg-type]
        stall_s=STALL_S, report=lambda kind, worker, detail: None,
    )  # fmt: skip
    return checker, worker


def _stream_on(decode: Worker) -> PairStreamOutcome:
    """A relayed stream that has just got its first byte (and is being sent to its client)."""
    return PairStreamOutcome(SimpleNamespace(), SimpleNamespace(decode=decode))  # type: ignore[arg-type]


def test_the_watchdog_counts_streams_from_their_first_byte_and_only_while_they_wait() -> None:
    async def scenario() -> None:
        checker, decode = _watched_decode()
        await checker.start()
        first = _stream_on(decode)
        first.waiting()
        await asyncio.sleep(STALL_S * 0.75)
        _stream_on(decode)  # its first byte is the decode's latest
        await asyncio.sleep(STALL_S * 0.75)
        assert decode.healthy, "the first stream waited past the stall time, but a byte came since"
        await asyncio.sleep(STALL_S * 0.75)
        assert not decode.healthy, "no bytes on either stream for the stall time"
        assert "2 open stream(s), 1 of them waiting on it" in decode.last_error
        await checker.aclose()

    asyncio.run(scenario())


def test_the_watchdog_ignores_streams_sent_to_a_slow_client() -> None:
    async def scenario() -> None:
        checker, decode = _watched_decode()
        await checker.start()
        stream = _stream_on(decode)
        stream.waiting()
        stream.progressed()  # bytes arrived; the relay is now blocked sending them to the client
        await asyncio.sleep(STALL_S * 3)
        assert decode.healthy, "the worker is not what is slow"
        stream.waiting()
        await asyncio.sleep(STALL_S * 2)
        assert not decode.healthy
        await checker.aclose()

    asyncio.run(scenario())


def _abort_delay(cluster: Cluster, running: RunningRouter, rid: str, target: Any) -> tuple[float, int]:
    """Send chat request `rid` (its X-Request-ID); seconds until `target` got /abort_request for
    the leg it was sent, and the status."""
    result: dict[str, int] = {}

    def send() -> None:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        result["status"] = httpx.post(
            running.url + CHAT, json=body, headers={"x-request-id": rid}, timeout=20
        ).status_code

    thread = threading.Thread(target=send)
    started = time.monotonic()
    thread.start()
    wait_until(lambda: any(leg["rid"] in target.aborts for leg in target.requests), timeout=5.0)
    delay = time.monotonic() - started
    thread.join(timeout=20)
    return delay, result["status"]


def test_a_failed_leg_aborts_the_other_at_once(cluster_factory: Callable[..., Cluster]) -> None:
    # Prefill fails: the decode, waiting for a KV hand-off that will never come, is aborted at
    # once instead of waiting out its handshake (10 s here).
    cluster = cluster_factory(1, 1, handshake_timeout=10.0)
    decode = cluster.decodes[0]
    with cluster.serve(cluster.config(max_retries=0)) as running:
        cluster.prefills[0].configure(fail_status=500, fail_count=1)
        delay, status = _abort_delay(cluster, running, "pf-fails", decode)
        assert delay < 0.5 and status == 502, (delay, status)

    # Decode fails while the prefill is still working: the prefill is aborted within the grace
    # the router gives a dying prefill to report first (0.1 s).
    cluster = cluster_factory(1, 2, prefill_delay=3.0)
    prefill = cluster.prefills[0]
    with cluster.serve(cluster.config(max_retries=0)) as running:
        for d in cluster.decodes:
            d.configure(fail_status=500, fail_count=1)
        delay, status = _abort_delay(cluster, running, "dc-fails", prefill)
        assert delay < 0.5 and status == 502, (delay, status)
