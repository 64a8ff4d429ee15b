"""Health probing against workers timed as sglang's `/health` is (a one-token generation: 200
after one 1 s tick at best, 503 after 20 s without output): the generation probe admits and
ejects, the instant liveness probe (`GET /v1/models`) keeps admitted workers, and with the
router's defaults busy workers stay healthy where the old settings (`/health` every 0.5 s with a
1 s timeout, one failure ejecting) never keep them."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from sglang_pd.deploy.router.config import RouterConfig
from sglang_pd.deploy.router.metrics import RouterMetrics
from sglang_pd.deploy.router.transport.client import Timeouts
from sglang_pd.deploy.router.workers import health
from sglang_pd.deploy.router.workers.health import HealthChecker
from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from tests.support.polling import wait_until
from tests.support.router_workers import FakeWorker, InProcessCluster

from ..conftest import Cluster

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CHAT = "/v1/chat/completions"
TOKENS = 20

# The router as it was: /health, a generation in sglang, every 0.5 s with a 1 s timeout, and one
# failure ejecting. In today's terms: only generation probes, that often and with that timeout.
OLD_SETTINGS: dict[str, Any] = {
    "health_interval_s": 0.5,
    "health_timeout_s": 1.0,
    "health_failure_threshold": 1,
    "health_generate_interval_s": 0.5,
    "health_generate_timeout_s": 1.0,
}


def keeps_healthy(cluster: Cluster, settings: dict[str, Any], *, streams: int = 32, duration_s: float = 15.0) -> bool:
    """Whether a router with `settings` over its defaults admits every worker within 5 s (sglang
    passes its first probe in about 1 s) and keeps them all healthy while `streams` concurrent
    streaming requests run for `duration_s`, every one of them complete. Stops at the first lapse."""
    config = cluster.config(RouterConfig(host="127.0.0.1", port=0, log_level="warning"), **settings)
    with cluster.serve(config, ready=False) as running:
        workers = running.app.registry.all()
        deadline = time.monotonic() + 5
        while not all(w.healthy for w in workers):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        lapses: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                lapses.extend(f"{w.role} {w.url}: {w.last_error}" for w in workers if not w.healthy)
                time.sleep(0.02)

        async def client_loop(client: httpx.AsyncClient, index: int, end: float) -> None:
            body = {"messages": [{"role": "user", "content": f"user {index}"}], "max_tokens": TOKENS, "stream": True}
            while time.monotonic() < end and not lapses:
                async with client.stream("POST", running.url + CHAT, json=body) as resp:
                    got = b"".join([chunk async for chunk in resp.aiter_raw()])
                if resp.status_code != 200 or len(re.findall(rb" tok\d+", got)) != TOKENS:
                    lapses.append(f"request answered {resp.status_code}: {got[-200:]!r}")

        async def load() -> None:
            end = time.monotonic() + duration_s
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=streams)) as client:
                await asyncio.gather(*(client_loop(client, i, end) for i in range(streams)))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            asyncio.run(load())
        finally:
            stop.set()
            watcher.join()
        if lapses:
            logging.getLogger(__name__).warning("health lapses: %s", lapses[:5])
        return not lapses


@pytest.fixture
def sglang_timed(cluster_factory: Callable[..., Cluster]) -> Cluster:
    """1 prefill and 2 decodes as real processes, with the test worker's default /health timing:
    sglang's."""
    return cluster_factory(1, 2, processes=True, health_tick_s=FakeWorker.health_tick_s, token_delay=0.05)


@pytest.mark.serial  # sglang's timing against the default probe timeouts: a latency bound
def test_busy_workers_stay_healthy_with_the_default_settings(sglang_timed: Cluster) -> None:
    assert keeps_healthy(sglang_timed, {})


def test_busy_workers_are_not_kept_healthy_with_the_old_settings(sglang_timed: Cluster) -> None:
    assert not keeps_healthy(sglang_timed, OLD_SETTINGS)


# -- the probes' rules, in process -------------------------------------------------------------


def _checker(worker: FakeWorker, **options: Any) -> tuple[HealthChecker, Worker]:
    """A checker probing `worker` (in process; liveness timeout 0.5 s) with `options`."""
    workers = InProcessCluster(0, 0)
    workers.workers[worker.url] = worker
    registry = WorkerRegistry()
    added = registry.add(worker.url, "decode")
    settings = {"interval_s": 0.05, "failure_threshold": 3, "success_threshold": 1, **options}
    client = workers.client(Timeouts(health=0.5, health_generate=2.0))
    return HealthChecker(registry, RouterMetrics(), client, **settings), added


def _decode(**options: Any) -> FakeWorker:
    return FakeWorker("decode", url="http://decode-0:30001", **options)


def test_a_worker_is_admitted_only_once_its_generation_probe_passes(caplog: pytest.LogCaptureFixture) -> None:
    fake = _decode(health_tick_s=0.05, starting_s=0.4)  # /health 503 while starting; /v1/models fine

    async def scenario() -> None:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        checker, worker = _checker(fake)
        await checker.start()
        assert not worker.healthy and worker.last_error == "GET /health answered 503"
        await asyncio.sleep(0.2)
        assert not worker.healthy and fake.models_checks == 0, "liveness probes do not admit"
        started = time.monotonic()
        while not worker.healthy:
            assert time.monotonic() - started < 2
            await asyncio.sleep(0.01)
        assert worker.models == ["test-model"] and worker.dp_size == 1
        await checker.aclose()

    asyncio.run(scenario())
    healthy = [r for r in caplog.records if r.getMessage() == "worker became healthy"]
    assert [getattr(r, "check", "") for r in healthy] == ["generation"]


def test_one_failed_generation_probe_ejects_a_frozen_scheduler_and_a_pass_readmits() -> None:
    # The scheduler stops while the HTTP process answers /v1/models: only the generation probe
    # can tell, after sglang's own timeout (0.3 s here).
    fake = _decode(health_tick_s=0.05, health_timeout_s=0.3)

    async def scenario() -> None:
        checker, worker = _checker(fake, generate_interval_s=0.2)
        await checker.start()
        assert worker.healthy
        fake.configure(frozen=True)
        started = time.monotonic()
        while worker.healthy:
            assert time.monotonic() - started < 2
            await asyncio.sleep(0.01)
        assert worker.last_error == "GET /health answered 503" and worker.consecutive_health_failures < 3
        fake.configure(frozen=False)
        while not worker.healthy:
            assert time.monotonic() - started < 3
            await asyncio.sleep(0.01)
        await checker.aclose()

    asyncio.run(scenario())


def test_one_generation_probe_in_flight_per_worker() -> None:
    fake = _decode(health_status=503, health_delay=0.3)  # a slow failing /health: never admitted

    async def scenario() -> None:
        checker, worker = _checker(fake)  # a round every 0.05 s
        await checker.start()
        await asyncio.sleep(0.7)
        assert not worker.healthy
        await checker.aclose()

    asyncio.run(scenario())
    assert fake.health_in_flight_max == 1 and 2 <= fake.health_checks <= 4, fake.health_checks


def test_start_waits_for_the_first_probes_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _decode(frozen=True)  # /health would answer 503 after 20 s
    monkeypatch.setattr(health, "START_WAIT_S", 0.8)  # 5 s by default

    async def scenario() -> None:
        checker, worker = _checker(fake, interval_s=60)
        started = time.monotonic()
        await checker.start()
        # START_WAIT_S, or the liveness timeout (0.5 s here) where it is longer.
        assert 0.75 <= time.monotonic() - started < 1.8
        assert not worker.healthy and fake.health_checks == 1, "the probe goes on"
        await checker.aclose()

    asyncio.run(scenario())


def test_a_worker_added_at_run_time_is_checked_before_the_answer(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, health_tick_s=0.3)
    admin = {"authorization": "Bearer admin-key"}
    config = RouterConfig(
        host="127.0.0.1", port=0, log_level="warning", admin_key="admin-key", worker_hosts=("prefill-0",)
    )
    with cluster.serve(config, ready=False) as running:
        p = cluster.prefills[0]
        body = {"url": p.url, "role": "prefill", "bootstrap_port": p.bootstrap_port}
        started = time.monotonic()
        added = httpx.post(running.url + "/workers", json=body, headers=admin, timeout=10)
        assert added.status_code == 201 and added.json()["healthy"] is True
        assert time.monotonic() - started >= 0.3, "answered after the generation probe passed"
        wait_until(lambda: httpx.get(running.url + "/readiness").json()["prefill"] == 1)


def test_the_test_workers_answer_probes_as_sglang_does() -> None:
    fake = _decode(health_tick_s=0.1, health_timeout_s=0.3, starting_s=0.2, dp_size=8)

    async def timed(path: str) -> tuple[int, float]:
        started = time.monotonic()
        reply = await fake.handle("GET", path, {}, b"")
        return reply.status, time.monotonic() - started

    async def scenario() -> None:
        status, took = await timed("/health")
        assert status == 503 and took < 0.05, "starting: 503 at once"
        await asyncio.sleep(0.2)
        for path in ("/health", "/health_generate"):
            status, took = await timed(path)
            assert status == 200 and took >= 0.1, "a pass takes one tick"
        fake.configure(frozen=True)
        status, took = await timed("/health")
        assert status == 503 and took >= 0.3, "no output for the whole timeout"
        for path in ("/v1/models", "/ping", "/get_model_info", "/model_info"):
            status, took = await timed(path)
            assert status == 200 and took < 0.05, "the HTTP process answers alone, frozen or not"

    asyncio.run(scenario())
    card = orjson.loads(asyncio.run(fake.handle("GET", "/v1/models", {}, b"")).body)["data"][0]  # type: ignore[arg-type]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(card)
    assert card["owned_by"] == "sglang"
    assert (fake.server_info()["dp_size"], fake.server_info()["attn_dp_size"]) == (1, 8)  # 0.5.23's layout
    old = _decode(dp_size=8, sglang_version="0.5.17").server_info()
    assert (old["dp_size"], old["enable_dp_attention"], "attn_dp_size" in old) == (8, True, False)
