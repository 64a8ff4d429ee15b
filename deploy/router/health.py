"""Periodic health checks, the confirmation probe of a worker's 5xx, and the stall watchdog.

A worker turns unhealthy after `failure_threshold` failed checks in a row and healthy again after
`success_threshold` passed ones; a new worker is checked at once. A passing check also refreshes
what the worker reports about itself (DP size, models). A worker coming back from unhealthy also
gets its circuit breaker closed: the probe has just shown it answers, and keeping it out for the
rest of a breaker cooldown would turn away traffic it can take.

`confirm(worker)` is the check `legs.Legs` asks for when a worker answers a request with a 5xx:
one `GET /health` right away, in the background, at most one in flight per worker (a 5xx that
arrives meanwhile shares it), bounded by the transport's health timeout. It is booked like any
other check, so a failed one counts towards ejection and health and breaker agree.

The watchdog ejects (marks unhealthy) a worker with relayed streams open that has sent no bytes on
any of them for `stall_s`: a frozen engine (SIGSTOP, a hung GPU) keeps its connections open, so
nothing else notices until a probe times out. The next passing probe readmits it.

In a serving process of a router process group (`group.py`) the group's control process owns
health: such a checker is given `report` and runs no periodic checks; a confirmation probe's outcome
and a stall are reported to the control process (which books and publishes them), and the stall
also takes the worker out of this process at once.

Every change of a worker's health is logged: "worker became healthy", "worker became unhealthy"
(also when a new worker fails its first check) and "worker ejected".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from .exceptions import UpstreamError
from .log import logger
from .metrics import RouterMetrics
from .transport import WorkerClient
from .workers import Worker, WorkerRegistry

__all__ = ["HealthChecker"]


class HealthChecker:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        client: WorkerClient,
        *,
        interval_s: float,
        failure_threshold: int,
        success_threshold: int,
        stall_s: float = 0.0,
        report: Callable[[str, Worker, str], None] | None = None,
    ) -> None:
        """`stall_s`: eject a worker whose open streams got no bytes for this long (0: off).
        `report(kind, worker, detail)`: hand findings to the group's control process instead of
        checking periodically (see the module docstring)."""
        self.registry = registry
        self.metrics = metrics
        self.client = client  # shared with the proxy: closed by its owner, not here
        self.interval_s = interval_s
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.stall_s = stall_s
        self.report = report
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._confirming: dict[Worker, asyncio.Future[bool]] = {}
        self._closed = False
        registry.subscribe(self._on_change)

    async def start(self) -> None:
        if self.report is None:
            await self.check_all()
            self._task = asyncio.create_task(self._loop())
        if self.stall_s > 0:
            self._watchdog = asyncio.create_task(self._watch_streams())

    async def aclose(self) -> None:
        self._closed = True
        for task in [self._task, self._watchdog, *self._pending]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _on_change(self, event: str, worker: Worker) -> None:
        if event == "added" and self.report is None:
            with contextlib.suppress(RuntimeError):  # no running loop: start() checks it
                task = asyncio.get_running_loop().create_task(self.check(worker))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
        elif event == "removed":
            self.metrics.forget_worker(worker.role, worker.url)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:
                logger.exception("health check round failed")

    async def _watch_streams(self) -> None:
        period = min(0.25, self.stall_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for worker in self.registry.all():
                if worker.healthy and worker.open_streams and now - worker.last_stream_bytes > self.stall_s:
                    reason = f"no bytes on its {worker.open_streams} open stream(s) for {self.stall_s:g} s"
                    self.eject(worker, reason)
                    if self.report is not None:
                        self.report("stalled", worker, reason)
                    worker.last_stream_bytes = now  # a new stall window once it is readmitted

    def eject(self, worker: Worker, reason: str) -> None:
        """Take `worker` out of routing until a probe passes again."""
        worker.healthy = False
        worker.consecutive_health_successes = 0
        worker.last_error = reason
        self.metrics.worker_healthy.labels(worker.role, worker.url).set(0)
        logger.warning("worker ejected", extra={"worker": worker.url, "role": worker.role, "error": reason})

    async def check_all(self) -> None:
        workers = self.registry.all()
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, worker: Worker) -> bool:
        """Probe `worker` and book the outcome; True when it passed."""
        ok, error = await self._probe(worker)
        needs_info = ok and (not worker.checked or not worker.models)
        self._book(worker, ok, error, "regular")
        if needs_info:
            await self._refresh_info(worker)
        return ok

    def confirm(self, worker: Worker) -> asyncio.Future[bool]:
        """A check of `worker` right away, in the background (see the module docstring); the
        result is True when the worker passed. A caller while one is in flight gets that one;
        once the checker is closed (the router is stopping), the result is a cancelled future."""
        task = self._confirming.get(worker)
        if task is None and self._closed:
            task = asyncio.get_running_loop().create_future()
            task.cancel()
        elif task is None:
            # A fresh context: the probe's log lines must not carry the request id of the
            # request that happened to start it.
            task = asyncio.get_running_loop().create_task(self._confirm(worker), context=contextvars.Context())
            self._confirming[worker] = task
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            task.add_done_callback(lambda _: self._confirming.pop(worker, None))
        return task

    async def _confirm(self, worker: Worker) -> bool:
        ok, error = await self._probe(worker)
        if self.report is None:
            self._book(worker, ok, error, "confirmation")
        else:
            self.report("probe_passed" if ok else "probe_failed", worker, error)
        return ok

    def book(self, worker: Worker, ok: bool, error: str, check: str) -> None:
        """Count a probe run elsewhere (by a serving process of the group) like one of ours."""
        self._book(worker, ok, error, check)

    def _book(self, worker: Worker, ok: bool, error: str, check: str) -> None:
        """Count a probe's outcome towards `worker`'s health, and log when that changes it."""
        was_healthy, first = worker.healthy, not worker.checked
        if ok:
            worker.consecutive_health_failures = 0
            worker.consecutive_health_successes += 1
            if first or worker.consecutive_health_successes >= self.success_threshold:
                worker.set_healthy(True)  # readmitted: see the module docstring
        else:
            worker.consecutive_health_successes = 0
            worker.consecutive_health_failures += 1
            worker.last_error = error
            if first or worker.consecutive_health_failures >= self.failure_threshold:
                worker.set_healthy(False)
        worker.checked = True
        if self.registry.get(worker.url, worker.role) is worker:
            self.metrics.worker_healthy.labels(worker.role, worker.url).set(int(worker.healthy))
            self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))
        if worker.healthy != was_healthy or (first and not worker.healthy):
            logger.log(
                logging.INFO if worker.healthy else logging.WARNING,
                "worker became " + ("healthy" if worker.healthy else "unhealthy"),
                extra={
                    "worker": worker.url,
                    "role": worker.role,
                    "error": error,
                    "check": check,
                    "consecutive_failures": worker.consecutive_health_failures,
                },
            )

    async def _probe(self, worker: Worker) -> tuple[bool, str]:
        try:
            status, _ = await self.client.get(worker, "/health")
        except UpstreamError as exc:
            return False, str(exc)
        if status != 200:
            return False, f"GET /health answered {status}"
        return True, ""

    async def _refresh_info(self, worker: Worker) -> None:
        info = await self._get_json(worker, "/server_info")
        if isinstance(info, dict):
            dp = info.get("dp_size")
            if isinstance(dp, int) and not isinstance(dp, bool) and dp > 0:
                worker.set_dp_size(dp)
        models = await self._get_json(worker, "/v1/models")
        if isinstance(models, dict) and isinstance(models.get("data"), list):
            worker.models = [m["id"] for m in models["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def _get_json(self, worker: Worker, path: str) -> Any:
        try:
            status, body = await self.client.get(worker, path)
            if status == 200:
                return orjson.loads(body)
        except (UpstreamError, ValueError) as exc:
            logger.debug("worker info request failed", extra={"worker": worker.url, "path": path, "error": str(exc)})
        return None
