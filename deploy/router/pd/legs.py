"""One leg of a PD request (the request to one worker) and the books kept around it: the worker's
in-flight count, its circuit breaker, the metrics and the log; `/abort_request` for legs given up.

What counts against a worker's circuit breaker: a transport error (`UpstreamUnreachable`) or a
timeout (`UpstreamTimeout`), at once; a 5xx (`UpstreamStatusError`, also an error as a stream's
first event) only when a health probe of the worker, started at that moment and run in the
background (`HealthChecker.confirm`), fails too. A 5xx whose worker passes the probe was caused by
the request itself (one bad request crashing a code path of the engine that keeps serving): it is
logged as "request-caused, not counted" and the breaker is left alone, so a few such requests
cannot take a healthy worker out of service. The request path never waits for the probe: the
proxy retries the request on another pair as it would anyway.

A worker that answers that it is full (`UpstreamBusy`: a 429, or sglang's 503 for a full queue)
has not failed: the answer is logged and counted as kind "busy", and nothing else happens to the
worker (no breaker count, no probe).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from typing import TYPE_CHECKING, Any

from ..exceptions import UpstreamBusy, UpstreamError, UpstreamStatusError, UpstreamTimeout
from ..log import logger, request_id_var
from ..metrics import RouterMetrics
from ..tracing import RequestTrace, current_trace, leg_headers
from ..transport.client import Reply, WorkerClient
from ..workers.registry import Worker

if TYPE_CHECKING:
    from ..workers.health import HealthChecker
    from ..workers.pairs import Pair

__all__ = ["Legs", "PairStreamOutcome"]


class Legs:
    """Sends legs through a WorkerClient and keeps each worker's books.

    `health` confirms a worker's 5xx before it counts (see the module docstring); without one
    (a Legs used on its own), a 5xx counts at once."""

    def __init__(self, client: WorkerClient, metrics: RouterMetrics, health: HealthChecker | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.health = health
        self._background: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=3.0)
        await self.client.aclose()

    async def post(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """A unary leg. Errors are raised, not recorded: the caller decides which leg is to blame."""
        if (trace := current_trace.get()) is not None:
            return await self._traced(trace, self._post, worker, path, body, rid)
        return await self._post(worker, path, body, rid)

    async def open_stream(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """A streamed leg up to its first chunk. While the stream is open the worker's in-flight
        count stays raised; a `PairStreamOutcome` ends it (or `end`, for a stream given up before
        its relay)."""
        if (trace := current_trace.get()) is not None:
            return await self._traced(trace, self._open_stream, worker, path, body, rid)
        return await self._open_stream(worker, path, body, rid)

    async def _traced(self, trace: RequestTrace, send: Any, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """`send` the leg under a span of its own, whose context goes to the engine (tracing.py)."""
        span, headers = trace.leg(worker, path, rid)
        token = leg_headers.set(headers)
        try:
            reply: Reply = await send(worker, path, body, rid)
        except BaseException as exc:
            trace.leg_ended(span, getattr(exc, "status", None), exc)
            raise
        finally:
            leg_headers.reset(token)
        trace.leg_ended(span, reply.status)
        return reply

    async def _post(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        worker.dispatched()
        try:
            reply = await self.client.post(worker, path, body, rid)
            self.succeeded(worker)
            return reply
        except BaseException:
            worker.breaker.release_probe()  # see _no_verdict
            raise
        finally:
            self.end(worker)

    async def _open_stream(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        worker.dispatched()
        try:
            reply = await self.client.open_stream(worker, path, body, rid)
        except BaseException:
            worker.breaker.release_probe()  # see _no_verdict
            self.end(worker)
            raise
        if reply.stream is None:  # the engine refused the request (4xx)
            self.succeeded(worker)
            self.end(worker)
        return reply

    # _no_verdict: a leg that ends in an exception frees its worker's half-open probe slot at
    # once. A cancelled leg (client gone, deadline, the other leg failed) says nothing about the
    # worker, and a failed one may be blamed on the other leg and never booked here; either way
    # the breaker would otherwise wait for a verdict that never comes. A failure that is booked
    # still opens the breaker (record_failure does not need the slot).

    def end(self, worker: Worker) -> None:
        worker.ended()

    def succeeded(self, worker: Worker) -> None:
        if worker.breaker.failures or worker.breaker.state:
            worker.breaker.record_success()
            self.metrics.breaker_state.labels(worker.role, worker.url).set(0)

    def failed(self, exc: UpstreamError, *, rid: str = "") -> None:
        """Book a failed leg: logged and counted in the metrics always, against the worker's
        breaker as the module docstring says. `rid`: the request's id for the log (default: the
        id of the request being served)."""
        worker = exc.worker
        if isinstance(exc, UpstreamBusy):
            self.metrics.upstream_errors.labels(worker.role, "busy").inc()
            logger.info("worker busy", extra={"worker": worker.url, "role": worker.role, "error": str(exc)})
            worker.breaker.release_probe()  # a half-open probe learnt nothing: the next request probes
            return
        worker.failed_with(str(exc))
        if isinstance(exc, UpstreamTimeout):
            kind = "timeout"
        elif isinstance(exc, UpstreamStatusError):
            kind = "status"
        else:
            kind = "unreachable"
        self.metrics.upstream_errors.labels(worker.role, kind).inc()
        logger.warning(
            "worker leg failed",
            extra={"worker": worker.url, "role": worker.role, "error": str(exc), "kind": kind},
        )
        if isinstance(exc, UpstreamStatusError) and self.health is not None:
            probe = self.health.confirm(worker)
            probe.add_done_callback(functools.partial(self._settle_status_error, exc, rid or request_id_var.get()))
            return
        self._count_failure(worker)

    def _settle_status_error(self, exc: UpstreamStatusError, rid: str, probe: asyncio.Future[bool]) -> None:
        """The confirmation probe of a 5xx ended: count the 5xx if the worker failed it too."""
        if probe.cancelled():  # the router is stopping: no verdict
            return
        worker = exc.worker
        error = probe.exception()
        if error is not None:  # a router bug, not the worker's answer: count, as without a probe
            logger.error("confirmation probe crashed", exc_info=error, extra={"worker": worker.url})
        confirmed = error is not None or not probe.result()
        self.metrics.upstream_status_errors.labels(worker.role, "true" if confirmed else "false").inc()
        extra = {"worker": worker.url, "role": worker.role, "request_id": rid, "status": exc.status}
        if confirmed:
            logger.warning("worker 5xx confirmed by a failed health probe, counted", extra=extra)
            self._count_failure(worker)
            return
        logger.warning("worker 5xx is request-caused, not counted", extra=extra)
        # If this leg was a half-open breaker's probe request, it gave no verdict on the worker:
        # the next request probes instead (otherwise the breaker would wait for this one forever).
        worker.breaker.release_probe()

    def _count_failure(self, worker: Worker) -> None:
        worker.breaker.record_failure()
        self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))

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
    """How a relayed decode stream ended, applied to the pair's books (a relay.StreamOutcome); also
    the stream's stall clock. From the moment the relay takes it over (its first byte has arrived)
    it is one of the decode's `streams`, and its first byte counts as the decode's latest; its
    clock runs only while the relay waits for the decode's next bytes (`waiting_since`), not while
    the relay is sending to a slow client: that is no sign of the worker's health."""

    __slots__ = ("chunks", "ending", "first_at", "last_at", "legs", "pair", "waiting_since")

    def __init__(self, legs: Legs, pair: Pair) -> None:
        self.legs = legs
        self.pair = pair
        self.waiting_since = math.inf
        # For the router's time per output token: the first chunk's arrival (now), the latest's,
        # and the chunks after the first.
        self.first_at = self.last_at = time.monotonic()
        self.chunks = 0
        self.ending = ""  # "completed", "failed" or "abandoned", once the stream ended
        pair.decode.stream_opened(self)

    def waiting(self) -> None:
        self.waiting_since = time.monotonic()

    def progressed(self) -> None:
        self.waiting_since = math.inf
        self.last_at = now = time.monotonic()
        self.chunks += 1
        self.pair.decode.stream_progressed(now)

    def time_per_chunk(self) -> float | None:
        """Mean time between the decode's chunks after the first; None for a one-chunk stream."""
        return (self.last_at - self.first_at) / self.chunks if self.chunks else None

    def completed(self) -> None:
        if self.ending:  # booked already (a moved stream's old outcome): once per stream
            return
        self.ending = "completed"
        self.legs.succeeded(self.pair.decode)
        self._close()

    def failed(self, error: UpstreamError) -> None:
        if self.ending:
            return
        self.ending = "failed"
        self.legs.failed(error, rid=self.pair.bodies.rids[0] if self.pair.bodies.rids else "")
        # The decode broke: the prefill may still hold the request (or its KV pages); free it now.
        self.legs.abort(self.pair.prefill, self.pair.bodies.rids)
        self._close()

    def abandoned(self) -> None:
        if self.ending:
            return
        self.ending = "abandoned"
        # The client is gone: stop both legs (the prefill may still be sending KV pages). The
        # stream gave no verdict on the decode: a half-open probe slot it held is freed.
        self.pair.decode.breaker.release_probe()
        self.legs.abort(self.pair.decode, self.pair.bodies.rids)
        self.legs.abort(self.pair.prefill, self.pair.bodies.rids)
        self._close()

    def _close(self) -> None:
        self.pair.decode.stream_closed(self)
        self.legs.end(self.pair.decode)
        if self.pair.reservation is not None:
            self.pair.reservation.release_decode()
