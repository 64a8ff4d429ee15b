"""Admission (429 with Retry-After, queue timeout), /workers at run time, metrics, and graceful
drain on SIGTERM of a router process started through its CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest

from sglang_pd.deploy.common.procs import spawn
from tests.support.polling import free_port, wait_until

from ..conftest import FAST, Cluster, serves_a_pair, wait_ready

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def test_over_capacity_is_429_with_retry_after(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.05)
    config = cluster.config(max_concurrent_requests=2, max_queued_requests=1, queue_timeout_s=0.3)
    with cluster.serve(config) as running:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=10) as client:
                return await asyncio.gather(*[client.post(running.url + CHAT, json=BODY) for _ in range(6)])

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) == 2, codes
        rejected = [r for r in responses if r.status_code == 429]
        assert len(rejected) == 4
        assert {r.json()["error"]["code"] for r in rejected} == {"queue_full", "queue_timeout"}
        assert all(r.headers["retry-after"].isdigit() for r in rejected)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
        # Every slot comes back and no waiter is left. The client can read a whole answer before
        # the server's handler has unwound and released its slot, so this is waited for.
        admission = running.app.admission
        wait_until(lambda: admission.active == 0 and not admission._waiters, timeout=5.0)


def test_queued_request_is_served_when_a_slot_frees(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.02)
    with cluster.serve(cluster.config(max_concurrent_requests=1, max_queued_requests=4, queue_timeout_s=5)) as running:

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=10) as client:
                rs = await asyncio.gather(*[client.post(running.url + CHAT, json=BODY) for _ in range(4)])
                return [r.status_code for r in rs]

        assert asyncio.run(burst()) == [200] * 4


def test_workers_added_and_removed_at_run_time(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    admin = {"Authorization": "Bearer admin-secret"}
    # Started with no workers: POST /workers may register only where --worker-hosts allows.
    config = replace(FAST, admin_key="admin-secret", worker_hosts=("prefill-0", "decode-0", "decode-9"))
    with cluster.serve(config, ready=False) as running:
        url = running.url
        assert httpx.get(url + "/readiness").json() == {"status": "ready", "prefill": 0, "decode": 0}
        p, d = cluster.prefills[0], cluster.decodes[0]
        added = httpx.post(url + "/workers", json={"url": p.url, "role": "prefill", "bootstrap_port": p.bootstrap_port},
                           headers=admin)  # fmt: skip
        assert added.status_code == 201 and added.json()["healthy"] is True
        assert httpx.post(url + "/workers", json={"url": d.url, "role": "decode"}, headers=admin).status_code == 201
        wait_ready(url)
        assert httpx.post(url + CHAT, json=BODY).status_code == 200
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "test-model"
        removed = httpx.delete(url + "/workers", params={"url": d.url}, headers=admin)
        assert removed.status_code == 200 and removed.json()["removed"][0]["role"] == "decode"
        assert httpx.post(url + CHAT, json=BODY).status_code == 503
        # An unreachable worker can be registered but is not used until it passes health checks.
        dead = httpx.post(url + "/workers", json={"url": "http://decode-9:30001", "role": "decode"}, headers=admin)
        assert dead.status_code == 201 and dead.json()["healthy"] is False
        assert httpx.get(url + "/readiness").json() == {"status": "ready", "prefill": 1, "decode": 0}


def test_removing_a_worker_frees_its_policy_state(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(2, 1)
    admin = {"Authorization": "Bearer admin-secret"}
    config = cluster.config(prefill_policy="cache_aware", admin_key="admin-secret")
    with cluster.serve(config) as running:
        policy = running.app.pairs.policies["prefill"]
        body = {"messages": [{"role": "user", "content": "a long shared system prompt " * 8}], "max_tokens": 1}
        assert httpx.post(running.url + CHAT, json=body).status_code == 200
        (served,) = [w for w in running.app.registry.prefill if policy.remembers(w)]  # type: ignore[attr-defined]
        removed = httpx.delete(running.url + "/workers", params={"url": served.url}, headers=admin)
        assert removed.status_code == 200
        assert not policy.remembers(served), "the departed worker's prefix tree is freed"  # type: ignore[attr-defined]
        assert httpx.post(running.url + CHAT, json=body).status_code == 200


def test_metrics_after_traffic(cluster_1p1d: Cluster, router_1p1d) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client() as client:
        client.post(router_1p1d.url + CHAT, json=BODY)
        client.post(router_1p1d.url + CHAT, json={**BODY, "stream": True})
        client.post(router_1p1d.url + CHAT, content=b"nope")
        text = client.get(router_1p1d.url + "/metrics").text
    for needle in (
        'sglang_pd_router_requests_total{endpoint="/v1/chat/completions",status="200"}',
        'sglang_pd_router_requests_total{endpoint="/v1/chat/completions",status="400"}',
        'sglang_pd_router_e2e_request_latency_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf",outcome="ok"}',
        'sglang_pd_router_time_to_first_token_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"}',
        'sglang_pd_router_time_to_first_token_part_seconds_bucket{le="+Inf",part="prefill",role="prefill"',
        f'sglang_pd_router_worker_in_flight{{role="decode",worker="{cluster_1p1d.decodes[0].url}"}} 0.0',
        "sglang_pd_router_worker_breaker_state",
        "sglang_pd_router_queue_depth",
        "sglang_pd_router_retries_total",
    ):
        assert needle in text, needle


def test_sigterm_drains_in_flight_streams(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, processes=True, token_delay=0.05)
    p, d = cluster.prefills[0], cluster.decodes[0]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url, "--policy", "round_robin",
           "--drain-timeout", "10", "--health-interval", "0.5", "--log-level", "warning"]  # fmt: skip
    router = spawn("router", cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_http(url + "/readiness", timeout_s=20)
        wait_until(lambda: serves_a_pair(url))
        with (
            httpx.Client(timeout=15) as client,
            client.stream("POST", url + CHAT, json={**BODY, "max_tokens": 30, "stream": True}) as resp,
        ):
            stream = resp.iter_raw()
            chunks = [next(stream)]
            os.kill(router.pid, signal.SIGTERM)
            time.sleep(0.3)
            # New connections are refused while the stream goes on.
            try:
                refused = httpx.post(url + CHAT, json=BODY, timeout=2).status_code == 503
            except httpx.ConnectError:
                refused = True
            assert refused
            chunks += list(stream)
        body = b"".join(chunks)
        assert body.count(b" tok") == 30 and body.endswith(b"data: [DONE]\n\n")
        assert router.proc.wait(timeout=10) == 0
    finally:
        router.stop(grace_s=1)
