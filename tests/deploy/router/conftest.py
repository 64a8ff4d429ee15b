"""Factory fixtures: protocol-faithful test workers, in process (reached through the router's
in-process transport) or as real processes on loopback, and a router served by uvicorn in a
background thread on a free port.

The fixtures' workers answer `/health` at once (`INSTANT_HEALTH`) and `FAST` probes them often,
so that a test starts in milliseconds; a test about health timing asks for sglang's (the
workers' defaults: a pass takes one 1 s tick) and the router's default settings itself."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from sglang_pd.deploy.router import RouterApp, RouterConfig, create_app
from sglang_pd.deploy.router.log import JsonFormatter, logger
from sglang_pd.deploy.router.server import RouterServer, uvicorn_config
from tests.support.router_worker_server import WorkerProcess, start_workers
from tests.support.router_workers import InProcessCluster

# Worker options of the fixtures: /health passes at once instead of after sglang's 1 s tick.
INSTANT_HEALTH: dict[str, Any] = {"health_tick_s": 0.0}

FAST = RouterConfig(
    host="127.0.0.1",
    port=0,
    prefill_policy="round_robin",
    decode_policy="round_robin",
    connect_timeout_s=1.0,
    request_timeout_s=10.0,
    stream_idle_timeout_s=5.0,
    health_interval_s=0.5,
    health_timeout_s=1.0,
    breaker_cooldown_s=30.0,
    retry_backoff_s=0.01,
    drain_timeout_s=5.0,
    log_level="warning",
)


class RunningRouter:
    def __init__(self, app: RouterApp, server: uvicorn.Server, thread: threading.Thread, port: int) -> None:
        self.app = app
        self.server = server
        self.thread = thread
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextlib.contextmanager
def serve_router(config: RouterConfig, **kwargs: Any) -> Iterator[RunningRouter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(replace(config, port=port), **kwargs)
    server = RouterServer(app, uvicorn_config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("The router did not start.")
        time.sleep(0.01)
    running = RunningRouter(app, server, thread, port)
    try:
        yield running
    finally:
        running.stop()
        sock.close()


def serves_a_pair(url: str) -> bool:
    """The router is ready and has a healthy prefill and decode (its /readiness body counts them)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        resp = httpx.get(url + "/readiness", timeout=1.0)
        return resp.status_code == 200 and resp.json()["prefill"] > 0 and resp.json()["decode"] > 0
    return False


def wait_ready(url: str, timeout: float = 10.0) -> None:
    """Until the router can serve a request: ready, with a healthy pair."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serves_a_pair(url):
            return
        time.sleep(0.05)
    raise RuntimeError(f"Router {url} had no healthy pair within {timeout} s.")


class Cluster:
    """Test workers and how a router reaches them: through the in-process transport when
    `inprocess` is set, over HTTP otherwise. Every worker has `url`, `bootstrap_port`, `state()`
    and `configure(...)`."""

    def __init__(self, prefills: list[Any], decodes: list[Any], inprocess: InProcessCluster | None = None) -> None:
        self.prefills = prefills
        self.decodes = decodes
        self.inprocess = inprocess

    def config(self, base: RouterConfig = FAST, **changes: Any) -> RouterConfig:
        return replace(
            base,
            prefill_workers=tuple((w.url, w.bootstrap_port) for w in self.prefills),
            decode_workers=tuple(w.url for w in self.decodes),
            **changes,
        )

    @contextlib.contextmanager
    def serve(self, config: RouterConfig, *, ready: bool = True, worker_api_key: str = "") -> Iterator[RunningRouter]:
        """A router in front of these workers; waits until it is ready unless `ready=False`."""
        client = None
        if self.inprocess is not None:
            client = self.inprocess.client(config.timeouts, api_key=worker_api_key)
        with serve_router(config, worker_api_key=worker_api_key, client=client) as running:
            if ready:
                wait_ready(running.url)
            yield running

    def kill(self, worker: Any) -> None:
        """The worker dies: SIGKILL for a process, unreachable from now on in process."""
        if self.inprocess is not None:
            self.inprocess.kill(worker)
        else:
            worker.kill()

    def stop(self) -> None:
        if self.inprocess is None:
            for w in self.prefills + self.decodes:
                w.stop()


def in_process(n_prefill: int, n_decode: int, **options: Any) -> Cluster:
    workers = InProcessCluster(n_prefill, n_decode, **{**INSTANT_HEALTH, **options})
    return Cluster(workers.prefills, workers.decodes, workers)


class RouterLog(logging.Handler):
    """The router's log lines from INFO on, as its JsonFormatter writes them: with the request's
    `request_id` (the router's own, the engines' rid) and `client_request_id`."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.entries: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entries.append(orjson.loads(self.format(record)))

    def finished(self, client_id: str, count: int = 1, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The "request finished" lines of the `count` requests sent with X-Request-ID `client_id`,
        once they are there (a stream finishes after its client got the last byte, and a request
        that outlives its client after the client left)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [
                entry
                for entry in list(self.entries)
                if entry["msg"] == "request finished" and entry.get("client_request_id") == client_id
            ]
            if len(lines) >= count:
                return lines
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(lines)} of {count} requests with X-Request-ID {client_id!r} finished")
            time.sleep(0.02)

    def router_id(self, client_id: str) -> str:
        """The router's id of the one request sent with X-Request-ID `client_id`."""
        (line,) = self.finished(client_id)
        return str(line["request_id"])


@pytest.fixture
def router_log() -> Iterator[RouterLog]:
    handler = RouterLog()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture(scope="module")
def cluster_1p1d() -> Iterator[Cluster]:
    yield in_process(1, 1)


@pytest.fixture(scope="module")
def router_1p1d(cluster_1p1d: Cluster) -> Iterator[RunningRouter]:
    with cluster_1p1d.serve(cluster_1p1d.config()) as running:
        yield running


@pytest.fixture(scope="module")
def worker_processes() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """One prefill and one decode test worker, as real processes."""
    prefills, decodes = start_workers(1, 1, no_log=True, **INSTANT_HEALTH)
    yield prefills[0], decodes[0]
    for w in prefills + decodes:
        w.stop()


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """`make(n_prefill, n_decode, processes=False, **worker_options)`: in-process workers, or
    real processes (for SIGKILL and for routers started from their CLI); `INSTANT_HEALTH` unless
    the options say otherwise."""
    made: list[Cluster] = []

    def make(n_prefill: int, n_decode: int, *, processes: bool = False, **options: Any) -> Cluster:
        if not processes:
            return in_process(n_prefill, n_decode, **options)
        cluster = Cluster(*start_workers(n_prefill, n_decode, **{**INSTANT_HEALTH, **options}))
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
