"""One leg of a PD request (the request to one worker) and the books kept around it: the worker's
in-flight count, its circuit breaker, the metrics and the log; `/abort_request` for legs given up.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from .exceptions import UpstreamError, UpstreamStatusError, UpstreamTimeout
from .log import logger
from .metrics import RouterMetrics
from .transport import Reply, WorkerClient
from .workers import Worker

if TYPE_CHECKING:
    from .pairs import Pair

__all__ = ["Legs", "PairStreamOutcome"]


class Legs:
    """Sends legs through a WorkerClient and keeps each worker's books."""

    def __init__(self, client: WorkerClient, metrics: RouterMetrics) -> None:
        self.client = client
        self.metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=3.0)
        await self.client.aclose()

    async def post(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """A unary leg. Errors are raised, not recorded: the caller decides which leg is to blame."""
        self._begin(worker)
        try:
            reply = await self.client.post(worker, path, body, rid)
            self.succeeded(worker)
            return reply
        finally:
            self.end(worker)

    async def open_stream(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """A streamed leg up to its first chunk. While the stream is open the worker's in-flight
        count stays raised; a `PairStreamOutcome` ends it."""
        self._begin(worker)
        try:
            reply = await self.client.open_stream(worker, path, body, rid)
        except BaseException:
            self.end(worker)
            raise
        if reply.stream is None:  # the engine refused the request (4xx)
            self.succeeded(worker)
            self.end(worker)
        else:
            if not worker.open_streams:
                worker.last_stream_bytes = time.monotonic()
            worker.open_streams += 1
        return reply

    def _begin(self, worker: Worker) -> None:
        worker.breaker.on_dispatch()
        worker.in_flight += 1

    def end(self, worker: Worker) -> None:
        worker.in_flight -= 1

    def succeeded(self, worker: Worker) -> None:
        if worker.breaker.failures or worker.breaker.state:
            worker.breaker.record_success()
            self.metrics.breaker_state.labels(worker.role, worker.url).set(0)

    def failed(self, exc: UpstreamError) -> None:
        worker = exc.worker
        worker.breaker.record_failure()
        worker.last_error = str(exc)
        if isinstance(exc, UpstreamTimeout):
            kind = "timeout"
        elif isinstance(exc, UpstreamStatusError):
            kind = "status"
        else:
            kind = "unreachable"
        self.metrics.upstream_errors.labels(worker.role, kind).inc()
        self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))
        logger.warning(
            "worker leg failed",
            extra={"worker": worker.url, "role": worker.role, "error": str(exc), "kind": kind},
        )

    def abort(self, worker: Worker, rids: list[str]) -> None:
        """Tell a worker to drop a request, in the background (bounded by the abort timeout)."""
        self.metrics.aborts.labels(worker.role).inc()

        async def send() -> None:
            for rid in rids:
                await self.client.abort(worker, rid)

        task = asyncio.ensure_future(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class PairStreamOutcome:
    """How a relayed decode stream ended, applied to the pair's books (a relay.StreamOutcome)."""

    def __init__(self, legs: Legs, pair: Pair) -> None:
        self.legs = legs
        self.pair = pair

    def progressed(self) -> None:
        self.pair.decode.last_stream_bytes = time.monotonic()

    def completed(self) -> None:
        self.legs.succeeded(self.pair.decode)
        self._close()

    def failed(self, error: UpstreamError) -> None:
        self.legs.failed(error)
        # The decode broke: the prefill may still hold the request (or its KV pages); free it now.
        self.legs.abort(self.pair.prefill, self.pair.bodies.rids)
        self._close()

    def abandoned(self) -> None:
        # The client is gone: stop both legs (the prefill may still be sending KV pages).
        self.legs.abort(self.pair.decode, self.pair.bodies.rids)
        self.legs.abort(self.pair.prefill, self.pair.bodies.rids)
        self._close()

    def _close(self) -> None:
        self.pair.decode.open_streams -= 1
        self.legs.end(self.pair.decode)
