"""Periodic health checks. A worker turns unhealthy after `failure_threshold` failed checks in a
row and healthy again after `success_threshold` passed ones; a new worker is checked at once. A
passing check also refreshes what the worker reports about itself (DP size, models)."""

from __future__ import annotations

import asyncio
import contextlib
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
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.client = client  # shared with the proxy: closed by its owner, not here
        self.interval_s = interval_s
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        registry.subscribe(self._on_change)

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def aclose(self) -> None:
        for task in [self._task, *self._pending]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _on_change(self, event: str, worker: Worker) -> None:
        if event == "added":
            with contextlib.suppress(RuntimeError):  # no running loop: start() checks it
                task = asyncio.get_running_loop().create_task(self.check(worker))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
        else:
            self.metrics.forget_worker(worker.role, worker.url)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:
                logger.exception("health check round failed")

    async def check_all(self) -> None:
        workers = self.registry.all()
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, worker: Worker) -> None:
        ok, error = await self._probe(worker)
        was_healthy = worker.healthy
        if ok:
            worker.consecutive_health_failures = 0
            worker.consecutive_health_successes += 1
            if not worker.checked or worker.consecutive_health_successes >= self.success_threshold:
                worker.healthy = True
            if not worker.checked or not worker.models:
                await self._refresh_info(worker)
        else:
            worker.consecutive_health_successes = 0
            worker.consecutive_health_failures += 1
            worker.last_error = error
            if not worker.checked or worker.consecutive_health_failures >= self.failure_threshold:
                worker.healthy = False
        worker.checked = True
        if self.registry.get(worker.url, worker.role) is worker:
            self.metrics.worker_healthy.labels(worker.role, worker.url).set(int(worker.healthy))
            self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))
        if worker.healthy != was_healthy:
            logger.info(
                "worker became " + ("healthy" if worker.healthy else "unhealthy"),
                extra={"worker": worker.url, "role": worker.role, "error": error},
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
