"""A worker whose HTTP server is at its connection cap answers the health probe 503 with
`x-sglpd-refused` (deploy/common/http_limits.py); the router's checker (workers/health.py) books
that as no verdict, so whoever holds the worker's connections cannot take it out of routing. A
plain 503 from `/health` (sglang's verdict) still ejects. Real server process, real HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import httpx
import pytest

from sglang_pd.deploy.router.metrics import RouterMetrics
from sglang_pd.deploy.router.transport.client import HttpWorkerClient, Timeouts
from sglang_pd.deploy.router.workers.health import HealthChecker
from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from tests.support.capped_server import capped_server

CAP = 4  # the worker's connection cap; one address may hold half of it
# Idle connections keep their slot for the test's length (the head timeout would free them).
LIMITS = {"max_connections": CAP, "header_timeout_s": 60.0}


def _alias_works() -> bool:
    with contextlib.suppress(OSError), socket.socket() as sock:
        sock.bind(("127.0.0.3", 0))
        return True
    return False


pytestmark = pytest.mark.skipif(not _alias_works(), reason="127.0.0.2 / 127.0.0.3 cannot be bound here")


def _checker(port: int) -> tuple[HealthChecker, Worker, HttpWorkerClient]:
    registry = WorkerRegistry()
    worker = registry.add(f"http://127.0.0.1:{port}", "decode")
    # No keep-alive: every probe opens a new connection, as one does after 4 s idle in production.
    client = HttpWorkerClient(timeouts=Timeouts(health=1.0, health_generate=2.0), keepalive_s=0.0)
    checker = HealthChecker(
        registry,
        RouterMetrics(),
        client,
        interval_s=0.05,
        generate_interval_s=0.05,
        failure_threshold=1,
        success_threshold=1,
    )
    return checker, worker, client


def _refused(sock: socket.socket) -> bool:
    """Whether the server answered (a refusal) or closed `sock`; an idle held one has neither."""
    try:
        return len(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= 0
    except BlockingIOError:
        return False


def _fill(port: int) -> list[socket.socket]:
    """Idle connections from two other addresses, each holding its half of the cap, until the cap
    is full: one refused while a probe's connection held a slot is opened again."""
    held: dict[str, list[socket.socket]] = {"127.0.0.2": [], "127.0.0.3": []}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for source, socks in held.items():
            for sock in [s for s in socks if _refused(s)]:
                sock.close()
                socks.remove(sock)
            while len(socks) < CAP // 2:
                socks.append(socket.create_connection(("127.0.0.1", port), source_address=(source, 0)))
        time.sleep(0.2)
        if not any(_refused(s) for socks in held.values() for s in socks):
            return [s for socks in held.values() for s in socks]
    raise AssertionError("the connection cap could not be filled")


def _raw_get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                data += chunk
        return data


async def _stays_healthy(worker: Worker, seconds: float) -> list[str]:
    """The lapses of `worker`'s health over `seconds`, polled every 10 ms."""
    lapses = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not worker.healthy:
            lapses.append(worker.last_error)
        await asyncio.sleep(0.01)
    return lapses


def test_a_worker_at_its_connection_cap_stays_healthy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sglang_pd.router")
    with capped_server(LIMITS) as port:

        async def scenario() -> None:
            checker, worker, client = _checker(port)
            await checker.start()
            assert worker.healthy, worker.last_error
            await client.aclose()  # the checker's idle connections go: the cap is the others' alone
            await asyncio.sleep(0.2)
            held = await asyncio.to_thread(_fill, port)  # the probes go on meanwhile
            try:
                await asyncio.sleep(0.2)
                refused = await asyncio.to_thread(_raw_get, port)  # the cap is full: a new connection is refused
                assert refused.startswith(b"HTTP/1.1 503 "), refused[:200]
                assert b"x-sglpd-refused: connection-limit" in refused
                caplog.clear()
                lapses = await _stays_healthy(worker, 1.5)  # about 30 generation probes' worth
                assert lapses == [], lapses[:3]
                refusals = [r for r in caplog.records if "connection cap" in r.getMessage()]
                assert len(refusals) >= 5, "the probes did reach the full server"
            finally:
                for sock in held:
                    sock.close()
            await asyncio.sleep(0.3)
            # Room again: the probes pass, and the worker never left.
            started = time.monotonic()
            while not await checker.check(worker, wait_s=1.0):  # one in flight may be a refused one
                assert time.monotonic() - started < 3, worker.last_error
            assert worker.healthy
            await checker.aclose()
            await client.aclose()

        asyncio.run(scenario())


def test_a_plain_503_from_health_still_ejects() -> None:
    with capped_server(LIMITS) as port:

        async def scenario() -> None:
            checker, worker, client = _checker(port)
            await checker.start()
            assert worker.healthy, worker.last_error
            async with httpx.AsyncClient() as http:
                assert (await http.post(f"http://127.0.0.1:{port}/health/503")).status_code == 200
            started = time.monotonic()
            while worker.healthy:
                assert time.monotonic() - started < 2, "a plain 503 did not eject"
                await asyncio.sleep(0.01)
            assert worker.last_error == "GET /health answered 503"
            await checker.aclose()
            await client.aclose()

        asyncio.run(scenario())
