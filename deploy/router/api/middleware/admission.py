"""Admission control: at most N requests in flight, a bounded FIFO queue with a timeout, 429 beyond,
503 while the router drains."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from ....common.openai_errors import error_body
from ...metrics import RouterMetrics
from ...timing import QUEUED
from .respond import send_json

__all__ = ["AdmissionMiddleware"]

_QUEUE_FULL = (
    "The router is at its limit of {limit} concurrent requests and its queue of {queued} is full. "
    "Retry after the Retry-After delay, or raise --max-concurrent-requests."
)
_QUEUE_TIMEOUT = (
    "The request waited {timeout:g} s for one of {limit} concurrent slots. "
    "Retry after the Retry-After delay, or raise --max-concurrent-requests / --queue-timeout."
)
_DRAINING = "The router is shutting down and takes no new requests. Retry on another router replica."


class AdmissionMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        paths: frozenset[str],
        max_concurrent: int,
        max_queued: int,
        queue_timeout_s: float,
        metrics: RouterMetrics,
        on_reject: Callable[[Scope, int], None] | None = None,
    ) -> None:
        """`on_reject(scope, status)`: told of each request this middleware answers itself."""
        self.app = app
        self.on_reject = on_reject
        self.paths = paths
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.active = 0
        self.draining = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._retry_after = str(max(1, math.ceil(queue_timeout_s / 4)))
        self._full_body = error_body(
            429, _QUEUE_FULL.format(limit=max_concurrent, queued=max_queued), code="queue_full"
        )
        self._timeout_body = error_body(
            429, _QUEUE_TIMEOUT.format(timeout=queue_timeout_s, limit=max_concurrent), code="queue_timeout"
        )
        self._draining_body = error_body(503, _DRAINING, code="draining")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.draining:
            self._rejected(scope, 503)
            await _reject(send, 503, self._draining_body, "5")
            return
        if self.max_concurrent and not await self._acquire(scope, send):
            return
        self.metrics.active.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.active.dec()
            if self.max_concurrent:
                self._release()

    def _rejected(self, scope: Scope, status: int) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, status)

    async def _acquire(self, scope: Scope, send: Send) -> bool:
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            return True
        if len(self._waiters) >= self.max_queued:
            self._rejected(scope, 429)
            await _reject(send, 429, self._full_body, self._retry_after)
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.metrics.queue_depth.inc()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await asyncio.shield(waiter)
            return True
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return True  # the slot arrived as the timer fired: keep it
            waiter.cancel()
            self._rejected(scope, 429)
            await _reject(send, 429, self._timeout_body, self._retry_after)
            return False
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()
            waiter.cancel()
            raise
        finally:
            scope[QUEUED] = time.perf_counter() - started  # the request's `queue` part (timing.py)
            self.metrics.queue_depth.dec()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # hand the slot over
                return
        self.active -= 1


async def _reject(send: Send, status: int, body: bytes, retry_after: str) -> None:
    await send_json(send, status, body, (b"retry-after", retry_after.encode()))
