"""P/D health coupling with real worker processes frozen by SIGSTOP: a frozen worker is ejected
within 2 s (by a timed-out probe, or by the stall watchdog when its open streams go quiet),
readiness follows the healthy pairs, and a resumed worker is readmitted within 1 s."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from sglang_pd.deploy.router.breaker import BreakerState
from tests.support.polling import wait_until

from .conftest import Cluster, RunningRouter

CHAT = "/v1/chat/completions"


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


def test_frozen_decode_is_ejected_by_probe_and_readmitted(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 2, processes=True)
    frozen_worker, other = cluster.decodes
    config = cluster.config(health_interval_s=0.5, health_timeout_s=1.0, health_failure_threshold=1)
    with cluster.serve(config) as running, httpx.Client(timeout=10) as client:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        worker = running.app.registry.get(frozen_worker.url, "decode")
        assert worker is not None
        worker.breaker.record_failure()  # a half-counted breaker must not delay the readmission
        with frozen(frozen_worker) as stopped:
            wait_until(lambda: not _healthy(running, frozen_worker.url), timeout=3.0)
            ejected_after = time.monotonic() - stopped
            assert ejected_after <= 2.0, ejected_after
            for _ in range(5):  # the rest of the cluster serves at once
                started = time.monotonic()
                assert client.post(running.url + CHAT, json=body).status_code == 200
                assert time.monotonic() - started < 1.0
            assert client.get(running.url + "/readiness").status_code == 200
        resumed = time.monotonic()
        wait_until(lambda: _healthy(running, frozen_worker.url), timeout=3.0)
        readmitted_after = time.monotonic() - resumed
        assert readmitted_after <= 1.0, readmitted_after
        assert worker.breaker.state is BreakerState.CLOSED
        other.configure(fail_status=503, fail_count=1000)  # the readmitted worker takes the traffic
        for _ in range(3):
            assert client.post(running.url + CHAT, json=body).status_code == 200


def test_stalled_stream_ejects_the_decode_and_readiness_follows(cluster_factory: Callable[..., Cluster]) -> None:
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
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
            started = time.monotonic()
            resp = client.post(running.url + CHAT, json={"messages": [{"role": "user", "content": "y"}]})
            assert resp.status_code == 503 and time.monotonic() - started < 1.0, "refused, not left waiting"
        reader.join(timeout=20)


def _abort_delay(cluster: Cluster, running: RunningRouter, rid: str, target: Any) -> tuple[float, int]:
    """Send chat request `rid`; seconds until `target` got /abort_request for it, and the status."""
    result: dict[str, int] = {}

    def send() -> None:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        result["status"] = httpx.post(
            running.url + CHAT, json=body, headers={"x-request-id": rid}, timeout=20
        ).status_code

    thread = threading.Thread(target=send)
    started = time.monotonic()
    thread.start()
    wait_until(lambda: rid in target.aborts, timeout=5.0)
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
