"""What counts against a worker's circuit breaker, with real worker processes: a 5xx counts only
when a liveness probe of the worker (`GET /v1/models`), run right away in the background, fails
too (at most one such probe in flight per worker); a transport error counts at once. Request-caused 5xx from a worker
that keeps serving are logged as not counted, and never open its breaker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.exceptions import UpstreamStatusError, UpstreamTimeout, UpstreamUnreachable
from sglang_pd.deploy.router.metrics import RouterMetrics
from sglang_pd.deploy.router.pd.legs import Legs
from sglang_pd.deploy.router.transport.client import WorkerClient
from sglang_pd.deploy.router.workers.breaker import BreakerState
from sglang_pd.deploy.router.workers.health import HealthChecker
from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from tests.support.polling import wait_until
from tests.support.router_workers import InProcessCluster

from ..conftest import Cluster, RunningRouter

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CHAT = "/v1/chat/completions"
NOT_COUNTED = "worker 5xx is request-caused, not counted"
COUNTED = "worker 5xx confirmed by a failed health probe, counted"
# Periodic probes are rare here: only the confirmation probes reach /v1/models during a test.
QUIET = {"health_interval_s": 60.0, "breaker_failure_threshold": 2}


def _chat(rid: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"question {rid}"}], "max_tokens": 2}


def _verdicts(running: RunningRouter, confirmed: bool) -> int:
    return int(running.app.metrics.upstream_status_errors.labels("decode", str(confirmed).lower())._value.get())


def _status_errors(running: RunningRouter) -> int:
    return int(running.app.metrics.upstream_errors.labels("decode", "status")._value.get())


def _router_worker(running: RunningRouter, url: str) -> Worker:
    worker = running.app.registry.get(url, "decode")
    assert worker is not None
    return worker


async def _burst(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=20) as client:
        replies = await asyncio.gather(
            *(client.post(url + CHAT, json=_chat(f"b{i}"), headers={"x-request-id": f"b{i}"}) for i in range(n))
        )
    return [r.status_code for r in replies]


def test_request_caused_5xx_leave_the_breaker_closed(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory(1, 2, processes=True)
    bad, _ = cluster.decodes
    n_errors = 6  # three times the breaker threshold
    with cluster.serve(cluster.config(**QUIET)) as running, httpx.Client(timeout=20) as client:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        bad.configure(fail_status=500, fail_count=n_errors)  # its /v1/models stays 200
        sent: list[str] = []  # the router's ids of the requests
        while _status_errors(running) < n_errors:
            assert len(sent) < 40, "the failing decode was never picked"
            resp = client.post(running.url + CHAT, json=_chat(f"r{len(sent)}"))
            assert resp.status_code == 200, resp.text  # retried on the other decode
            sent.append(resp.headers["x-router-request-id"])
        wait_until(lambda: _verdicts(running, confirmed=False) == n_errors)
        worker = _router_worker(running, bad.url)
        assert worker.breaker.state is BreakerState.CLOSED and worker.breaker.failures == 0
        assert worker.healthy and _verdicts(running, confirmed=True) == 0
        # The worker keeps taking traffic: both decodes serve the next requests.
        before = len(bad.state()["requests"])
        for i in range(6):
            assert client.post(running.url + CHAT, json=_chat(f"after{i}")).status_code == 200
        assert len(bad.state()["requests"]) > before
        assert client.get(running.url + "/readiness").status_code == 200
    lines = [r for r in caplog.records if r.getMessage() == NOT_COUNTED]
    assert len(lines) == n_errors
    for record in lines:
        assert getattr(record, "worker", "") == bad.url and getattr(record, "status", 0) == 500
        assert getattr(record, "request_id", "") in sent
    assert not [r for r in caplog.records if "circuit breaker" in r.getMessage()], "no breaker transition"


def test_5xx_with_a_failing_health_probe_opens_the_breaker_and_ejects(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory(1, 2, processes=True)
    bad, _ = cluster.decodes
    config = cluster.config(**QUIET, health_failure_threshold=1, health_timeout_s=3.0)
    with cluster.serve(config) as running:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        # The engine is broken, not the request: /v1/models fails as well (slowly, so that the
        # burst's 5xx all wait on one probe).
        bad.configure(fail_status=500, fail_count=1000, models_status=503, models_delay=0.5)
        statuses = asyncio.run(_burst(running.url, 10))
        assert statuses == [200] * 10  # retried on the other decode meanwhile
        errors = _status_errors(running)
        assert errors >= 3, errors
        wait_until(lambda: _verdicts(running, confirmed=True) == errors)
        worker = _router_worker(running, bad.url)
        assert worker.breaker.state is BreakerState.OPEN
        assert not worker.healthy and worker.consecutive_health_failures == 1
        assert bad.state()["models_in_flight_max"] == 1
        # Traffic goes to the other decode only.
        before = len(bad.state()["requests"])
        with httpx.Client(timeout=20) as client:
            for i in range(4):
                assert client.post(running.url + CHAT, json=_chat(f"after{i}")).status_code == 200
        assert len(bad.state()["requests"]) == before
    messages = [(r.getMessage(), getattr(r, "worker", "")) for r in caplog.records]
    assert (COUNTED, bad.url) in messages
    assert ("circuit breaker closed -> open", f"decode {bad.url}") in messages
    unhealthy = [r for r in caplog.records if r.getMessage() == "worker became unhealthy"]
    assert [(getattr(r, "worker", ""), getattr(r, "check", "")) for r in unhealthy] == [(bad.url, "confirmation")]
    assert not [r for r in caplog.records if r.getMessage() == NOT_COUNTED]


def test_one_confirmation_probe_per_worker_under_a_burst(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 2, processes=True)
    bad, _ = cluster.decodes
    with cluster.serve(cluster.config(**QUIET, health_timeout_s=3.0)) as running:
        bad.configure(fail_status=500, fail_count=1000, models_delay=1.0)
        probes_before = bad.state()["models_checks"]
        assert asyncio.run(_burst(running.url, 16)) == [200] * 16
        errors = _status_errors(running)
        assert errors >= 6, errors
        wait_until(lambda: _verdicts(running, confirmed=False) == errors)
        state = bad.state()
        assert state["models_checks"] - probes_before == 1, (state["models_checks"], probes_before, errors)
        assert state["models_in_flight_max"] == 1
        assert _router_worker(running, bad.url).breaker.state is BreakerState.CLOSED
        # The probe finished: the next 5xx gets a probe of its own.
        with httpx.Client(timeout=20) as client:
            while _status_errors(running) == errors:
                assert client.post(running.url + CHAT, json=_chat("again")).status_code == 200
        wait_until(lambda: bad.state()["models_checks"] - probes_before == 2)


def test_transport_errors_count_at_once(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 2, processes=True)
    victim, _ = cluster.decodes
    with cluster.serve(cluster.config(**QUIET)) as running, httpx.Client(timeout=20) as client:
        worker = _router_worker(running, victim.url)
        victim.kill()
        while worker.breaker.failures == 0:
            assert client.post(running.url + CHAT, json=_chat("k")).status_code == 200
        # Counted before the request's answer came back, with no probe to wait for.
        assert running.app.metrics.upstream_errors.labels("decode", "unreachable")._value.get() == 1
        while worker.breaker.state is not BreakerState.OPEN:
            assert client.post(running.url + CHAT, json=_chat("k")).status_code == 200
        assert worker.breaker.failures == 2 and worker.healthy, "the breaker alone took it out"
        assert _verdicts(running, confirmed=True) == _verdicts(running, confirmed=False) == 0


# -- Legs on its own: what counts at once, what waits for the probe -----------------------------


class _Probe:
    """Stands in for HealthChecker.confirm: one future per call, resolved by the test."""

    def __init__(self) -> None:
        self.calls: list[Worker] = []
        self.future: asyncio.Future[bool] | None = None

    def confirm(self, worker: Worker) -> asyncio.Future[bool]:
        self.calls.append(worker)
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()
        return self.future


def _legs_and_worker(threshold: int = 1) -> tuple[Legs, _Probe, Worker]:
    probe = _Probe()
    legs = Legs(client=None, metrics=RouterMetrics(), health=probe)  # type: ignore[arg-type]
    worker = WorkerRegistry(breaker_failure_threshold=threshold).add("http://decode-0:1", "decode", healthy=True)
    return legs, probe, worker


def test_legs_count_transport_errors_and_timeouts_without_a_probe() -> None:
    async def scenario() -> None:
        legs, probe, worker = _legs_and_worker(threshold=2)
        legs.failed(UpstreamUnreachable("refused", worker))
        assert worker.breaker.failures == 1
        legs.failed(UpstreamTimeout("timed out", worker))
        assert worker.breaker.state is BreakerState.OPEN and not probe.calls

    asyncio.run(scenario())


@pytest.mark.parametrize("worker_ok", [True, False])
def test_legs_wait_for_the_probe_before_counting_a_5xx(worker_ok: bool) -> None:
    async def scenario() -> None:
        legs, probe, worker = _legs_and_worker(threshold=2)
        for rid in ("a", "b"):
            legs.failed(UpstreamStatusError("500", worker, 500, b""), rid=rid)
        assert worker.breaker.failures == 0 and len(probe.calls) == 2
        assert probe.future is not None
        probe.future.set_result(worker_ok)
        await asyncio.sleep(0)
        if worker_ok:
            assert worker.breaker.state is BreakerState.CLOSED and worker.breaker.failures == 0
        else:
            assert worker.breaker.state is BreakerState.OPEN and worker.breaker.failures == 2
        verdicts = legs.metrics.upstream_status_errors.labels("decode", str(not worker_ok).lower())
        assert verdicts._value.get() == 2

    asyncio.run(scenario())


def test_request_caused_5xx_frees_a_half_open_probe_slot() -> None:
    async def scenario() -> None:
        legs, probe, worker = _legs_and_worker(threshold=1)
        worker.breaker.record_failure(now=0)
        worker.breaker.on_dispatch(now=worker.breaker.cooldown_s + 1)  # this leg is the probe request
        assert worker.breaker.state is BreakerState.HALF_OPEN and not worker.breaker.can_dispatch()
        legs.failed(UpstreamStatusError("500", worker, 500, b""))
        assert probe.future is not None
        probe.future.set_result(True)
        await asyncio.sleep(0)
        assert worker.breaker.state is BreakerState.HALF_OPEN and worker.breaker.can_dispatch()

    asyncio.run(scenario())


class _Hanging(WorkerClient):
    """A worker that never answers."""

    async def _send(self, *args: Any) -> Any:
        await asyncio.Event().wait()


@pytest.mark.parametrize("leg", ["post", "open_stream"])
def test_a_cancelled_leg_frees_a_half_open_probe_slot(leg: str) -> None:
    # The probe request of a half-open breaker is cancelled (client gone, deadline, the other leg
    # failed): no verdict on the worker, so the next request must be let through as the probe.
    async def scenario() -> None:
        legs = Legs(_Hanging(), RouterMetrics())
        worker = WorkerRegistry(breaker_failure_threshold=1).add("http://decode-0:1", "decode", healthy=True)
        worker.breaker.record_failure(now=0)  # opened long ago: the next dispatch is the probe
        task = asyncio.ensure_future(getattr(legs, leg)(worker, "/generate", b"{}", "probe"))
        await asyncio.sleep(0)
        assert worker.breaker.state is BreakerState.HALF_OPEN and not worker.breaker.can_dispatch()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert worker.breaker.can_dispatch() and worker.in_flight == 0

    asyncio.run(scenario())


# -- HealthChecker: the confirmation probe is a liveness probe like the others -------------------


def test_confirmation_probe_is_shared_and_booked_as_a_health_check(caplog: pytest.LogCaptureFixture) -> None:
    workers = InProcessCluster(0, 1, health_tick_s=0.0)
    decode = workers.decodes[0]
    registry = WorkerRegistry()
    checker = HealthChecker(
        registry, RouterMetrics(), workers.client(), interval_s=60, failure_threshold=2, success_threshold=1
    )

    async def scenario() -> None:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        worker = registry.add(decode.url, "decode")
        assert await checker.check(worker) and worker.healthy
        await asyncio.sleep(0.01)  # the check that registering the worker started is over too
        probes_before = decode.models_checks
        decode.configure(models_status=503, models_delay=0.05)
        first, second = checker.confirm(worker), checker.confirm(worker)
        assert first is second, "one probe in flight per worker"
        assert await first is False
        assert worker.healthy and worker.consecutive_health_failures == 1  # below the threshold of 2
        third = checker.confirm(worker)
        assert third is not first and await third is False
        assert not worker.healthy and decode.models_checks - probes_before == 2
        await checker.aclose()

    asyncio.run(scenario())
    unhealthy = [r for r in caplog.records if r.getMessage() == "worker became unhealthy"]
    assert len(unhealthy) == 1 and getattr(unhealthy[0], "check", "") == "confirmation"


def test_a_new_worker_failing_its_first_check_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    workers = InProcessCluster(0, 1)
    workers.decodes[0].configure(health_status=500)
    registry = WorkerRegistry()
    checker = HealthChecker(
        registry, RouterMetrics(), workers.client(), interval_s=60, failure_threshold=3, success_threshold=1
    )

    async def scenario() -> None:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        worker = registry.add(workers.decodes[0].url, "decode")
        assert not await checker.check(worker)
        assert not worker.healthy
        await checker.aclose()

    asyncio.run(scenario())
    unhealthy = [r for r in caplog.records if r.getMessage() == "worker became unhealthy"]
    assert len(unhealthy) == 1 and "500" in getattr(unhealthy[0], "error", "")
