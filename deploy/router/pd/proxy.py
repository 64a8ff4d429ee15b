"""PD orchestration: the attempt loop and the race between the two legs.

An attempt picks a (prefill, decode) pair, sends the same body (plus the bootstrap fields) to
both at once and waits for decode's answer, or its first chunk when streaming, while watching the
prefill leg and the client. A failed leg makes the attempt worth retrying on another pair while
nothing has reached the client; the other leg of a given-up attempt is always aborted.

Before the first attempt, a token limit above the model's context length is refused (400), and a
request that finds every pair at its capacity waits for room in the `CapacityGate` (429 after the
queue timeout). A worker's answer that it is full (`UpstreamBusy`) is no failure: the request
tries another pair that has room right away, and otherwise gets the busy status (503 or 429) with
Retry-After.

A stream whose decode fails mid-stream (`/generate`, `/v1/completions`, `/v1/chat/completions`)
moves to another pair (`StreamMover`, migration.py, migration_openai.py) up to `migration_limit`
times; the client's stream goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from starlette.responses import Response

from ...common.openai_errors import ApiError, normalize_error_body
from ..api.request_ids import RequestIds
from ..api.validation import batch_size
from ..config import RouterConfig
from ..exceptions import (
    ClientGone,
    NoHealthyWorker,
    UpstreamBusy,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    WorkerAtCapacity,
)
from ..log import logger
from ..timing import Timing
from ..transport.client import Body, Reply
from ..workers.capacity import CapacityGate, Demand, Reservation, check_max_tokens, check_prompt, estimate
from ..workers.pairs import Pair, PairPicker
from ..workers.registry import Worker
from .bootstrap import PDBodies
from .legs import Legs, PairStreamOutcome
from .logprobs import merge_first_event, merge_logprobs, wants_input_logprobs
from .migration import Migration
from .migration_openai import migration_for
from .relay import ClientWatch, RelayResponse, openai_finish_reasons
from .tasks import cancel_legs, finished_ok, first_done

__all__ = ["PDProxy"]

# Decode answered with an error: a dying prefill (failed KV transfer) is the usual cause, and its
# connection error is due within moments; wait that long before blaming the decode.
_BLAME_GRACE_S = 0.1
# How long a request that asked for the TTFT breakdown waits for the prefill's answer before its
# first bytes leave (`_prefill_answer_for`): sglang's prefill answers within moments of the decode's
# first token, both following the same transfer event.
PREFILL_ANSWER_WAIT_S = 2.0

OpenLeg = Callable[[Worker, str, bytes, str], Coroutine[Any, Any, Reply]]


class PDProxy:
    def __init__(self, config: RouterConfig, pairs: PairPicker, legs: Legs) -> None:
        self.config = config
        self.pairs = pairs
        self.legs = legs
        self._rng = random.Random()
        # With no healthy worker: a worker can be admitted at the next probe round.
        self._retry_after = str(max(1, math.ceil(config.health_interval_s)))
        # Requests waiting for a pair with room share the admission queue's bounds (capacity.py).
        depth = legs.metrics.capacity_queue_depth
        self.gate = CapacityGate(
            max_waiting=config.max_queued_requests,
            timeout_s=config.queue_timeout_s,
            on_depth=depth.set,
            registry=pairs.registry,
            reserve=config.client_reserve,
        )

    async def unary(
        self, endpoint: str, payload: dict[str, Any], ids: RequestIds, watch: ClientWatch, timing: Timing
    ) -> Response:
        try:
            _, reply, prefill_t = await self._attempts(
                endpoint, payload, ids.router, self.legs.post, watch.gone, timing
            )
        finally:
            watch.stop()
        body = reply.body
        if reply.status < 300 and wants_input_logprobs(endpoint, payload):
            body = await self._with_prefill_logprobs(prefill_t, body, merge_logprobs)
        self._watch_prefill(prefill_t)
        if reply.status >= 400:
            return _refused(reply, ids)
        if endpoint != "/generate":
            body = openai_finish_reasons(body)
        await _prefill_answer_for(timing, prefill_t)
        headers = _headers(ids, timing, body)
        return Response(body, status_code=reply.status, media_type=reply.content_type, headers=headers)

    async def stream(
        self, endpoint: str, payload: dict[str, Any], ids: RequestIds, watch: ClientWatch, timing: Timing
    ) -> Response:
        # One watch on the client for the whole request: the relay takes it over.
        migration = migration_for(endpoint, payload) if self.config.migration_limit else None
        try:
            open_decode = self.legs.open_stream
            pair, reply, prefill_t = await self._attempts(
                endpoint, payload, ids.router, open_decode, watch.gone, timing,
                decode_extra=migration.decode_extra() if migration is not None else None,
            )  # fmt: skip
            if reply.stream is None:  # decode refused (4xx)
                self._watch_prefill(prefill_t)
                watch.stop()
                return _refused(reply, ids)
            first = reply.body
            if wants_input_logprobs(endpoint, payload):
                try:
                    first = await self._with_prefill_logprobs(prefill_t, first, merge_first_event)
                except BaseException:
                    self._give_up(pair, reply.stream)
                    raise
        except BaseException:
            watch.stop()
            raise
        self._watch_prefill(prefill_t)
        outcome = PairStreamOutcome(self.legs, pair)
        await _prefill_answer_for(timing, prefill_t)
        headers = _headers(ids, timing, first)
        mover = None
        if migration is not None:
            mover = StreamMover(self, endpoint, ids.router, migration, pair, watch.gone)
        return RelayResponse(
            reply,
            first,
            outcome,
            headers=headers,
            watch=watch,
            openai=endpoint != "/generate",
            mover=mover,
            slow_reader_s=self.config.slow_reader_timeout_s,
        )

    async def _attempts(
        self,
        endpoint: str,
        payload: dict[str, Any],
        rid: str,
        open_decode: OpenLeg,
        disconnect: asyncio.Future[None],
        timing: Timing,
        *,
        exclude: list[Worker] | None = None,
        decode_extra: dict[str, Any] | None = None,
    ) -> tuple[Pair, Reply, asyncio.Task[Reply]]:
        """Run attempts until decode gives an answer (or its first chunk), or `disconnect` (the
        client left) ends them. `rid`: the router's id of the request (never the client's: the
        engines abort by it). `exclude`: workers not to pick (a migrated stream's failed decode);
        `decode_extra`: fields for the decode leg only (migration.py). Returns the pair, decode's
        reply and the prefill task (possibly still running)."""
        check_max_tokens(endpoint, payload, self.pairs.registry)
        demand = estimate(endpoint, payload, batch_size(endpoint, payload))
        check_prompt(endpoint, payload, demand, self.pairs.registry)  # one that can never run: refused now
        exclude = list(exclude or ())
        loop = disconnect.get_loop()  # not asyncio.get_running_loop(): see tasks.first_done
        last_error: UpstreamError | None = None
        deadline: float | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                delay = min(self.config.retry_max_backoff_s, self.config.retry_backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + self._rng.random()))
            # Each attempt gets its own rid: an abort sent for a failed attempt must not hit
            # the retry, and sglang refuses a rid that is still in flight.
            attempt_rid = rid if attempt == 0 else f"{rid}.{attempt}"
            try:
                pair = await self._pick(
                    endpoint, payload, attempt_rid, exclude, demand, disconnect, timing if not attempt else None
                )
            except (NoHealthyWorker, WorkerAtCapacity) as exc:
                if last_error is not None:
                    raise _gave_up(last_error, attempt) from exc
                # Streamed or not, nothing has been sent yet: a plain OpenAI-shaped 503.
                raise ApiError(
                    503, str(exc), code="no_healthy_worker", headers={"retry-after": self._retry_after}
                ) from exc
            if decode_extra:
                pair.bodies = _with_fields(pair.bodies, decode_extra)
            if deadline is None:  # the time waited for room does not count against the request
                deadline = loop.time() + self.config.request_timeout_s
            reservation = pair.reservation
            assert reservation is not None
            prefill_t = loop.create_task(self.legs.post(pair.prefill, endpoint, pair.bodies.prefill, attempt_rid))
            prefill_t.add_done_callback(reservation.release_prefill)
            timing.legs_sent(prefill_t)
            if pair.dp_ranks:
                prefill_t.add_done_callback(pair.release_ranks)
            decode_t = loop.create_task(open_decode(pair.decode, endpoint, pair.bodies.decode, attempt_rid))
            decode_t.add_done_callback(functools.partial(_release_unless_streaming, reservation))
            try:
                outcome = await self._race(pair, prefill_t, decode_t, disconnect, deadline)
            except BaseException:
                cancel_legs(prefill_t, decode_t)
                self._abort_unfinished(pair, decode_t)
                raise
            if isinstance(outcome, Reply):
                timing.first = time.perf_counter()
                timing.prefill, timing.decode = pair.prefill, pair.decode
                return pair, outcome, prefill_t
            last_error = outcome
            exclude.append(outcome.worker)
            self.legs.metrics.retries.labels(outcome.worker.role).inc()
        assert last_error is not None
        raise _gave_up(last_error, self.config.max_retries + 1)

    async def _pick(
        self,
        endpoint: str,
        payload: dict[str, Any],
        rid: str,
        exclude: list[Worker],
        demand: Demand,
        disconnect: asyncio.Future[None],
        timing: Timing | None,
    ) -> Pair:
        """A pair with room for `demand`, its capacity reserved. The first attempt (the one with
        `timing`, which learns the wait) waits its turn in the gate while every pair is full (or
        others wait already: no request jumps the queue); a retry does not wait, it raises
        WorkerAtCapacity."""

        def pick() -> Pair:
            pair = self.pairs.pick(endpoint, payload, rid, exclude, demand)
            # Reserved in the same tick as the pick: no other request can take the same room.
            pair.reservation = Reservation(pair.prefill, pair.decode, demand, self.gate.notify, self.gate.ledger)
            return pair

        if timing is None:
            return pick()
        if not self.gate.must_wait(demand):
            try:
                return pick()
            except WorkerAtCapacity:
                pass
        started = time.perf_counter()
        try:
            return await self.gate.wait(pick, disconnect, demand)
        finally:
            timing.queued += time.perf_counter() - started

    async def _race(
        self,
        pair: Pair,
        prefill_t: asyncio.Task[Reply],
        decode_t: asyncio.Task[Reply],
        disconnect: asyncio.Future[None],
        deadline: float,
    ) -> Reply | UpstreamError:
        """Wait for decode's answer while watching prefill and the client. Returns the answer
        (decode's, or prefill's own 4xx refusal), or the leg error that makes this attempt worth
        retrying on another pair."""
        loop = disconnect.get_loop()
        # The prefill leg matters here only when it fails: a prefill that succeeds (the usual
        # case, before decode answers) does not wake this task.
        prefill_failed: asyncio.Future[None] = loop.create_future()

        def on_prefill(task: asyncio.Task[Reply]) -> None:
            if prefill_failed.done() or task.cancelled():
                return
            if task.exception() is not None or task.result().status >= 400:
                prefill_failed.set_result(None)

        prefill_t.add_done_callback(on_prefill)
        watched: set[asyncio.Future[Any]] = {prefill_failed, decode_t, disconnect}
        rids = pair.bodies.rids
        try:
            timeout = deadline - loop.time()
            done = await first_done(loop, watched, timeout)
            if not done:
                raise _timeout_error(self.config.request_timeout_s)
            if disconnect in done:
                raise ClientGone()
            if prefill_failed in done:
                if finished_ok(decode_t):
                    return decode_t.result()  # decode answered; prefill's failure no longer matters
                cancel_legs(decode_t)
                self.legs.abort(pair.decode, rids)
                exc = prefill_t.exception()
                if isinstance(exc, UpstreamError):
                    self.legs.failed(exc)
                    return exc
                if exc is not None:
                    raise exc
                return prefill_t.result()  # the engine refused the request itself (4xx)
            # decode_t is done.
            exc = decode_t.exception()
            if exc is None:
                reply = decode_t.result()
                if reply.status >= 400 and not prefill_t.done():
                    cancel_legs(prefill_t)
                    self.legs.abort(pair.prefill, rids)
                return reply
            if isinstance(exc, UpstreamStatusError) and not prefill_t.done():
                await asyncio.wait({prefill_t}, timeout=_BLAME_GRACE_S)
            prefill_exc = prefill_t.exception() if prefill_t.done() and not prefill_t.cancelled() else None
            if not prefill_t.done():
                cancel_legs(prefill_t)
                self.legs.abort(pair.prefill, rids)
            if not isinstance(exc, UpstreamError):
                raise exc
            if isinstance(exc, UpstreamStatusError) and isinstance(prefill_exc, UpstreamError):
                exc = prefill_exc  # the prefill's fault, not the decode's
            self.legs.failed(exc)
            return exc
        finally:
            prefill_t.remove_done_callback(on_prefill)

    def _abort_unfinished(self, pair: Pair, decode_t: asyncio.Task[Reply]) -> None:
        # The request is given up (client gone, deadline passed): both legs get /abort_request,
        # a finished prefill too, since the decode may still be pulling its KV cache.
        self._give_up(pair, decode_t.result().stream if finished_ok(decode_t) else None)

    def _give_up(self, pair: Pair, opened: Body | None) -> None:
        """Abort both legs; close decode's stream if it opened one (the relay never took it)."""
        self.legs.abort(pair.prefill, pair.bodies.rids)
        self.legs.abort(pair.decode, pair.bodies.rids)
        if opened is not None:
            opened.close()
            self.legs.end(pair.decode)
            if pair.reservation is not None:
                pair.reservation.release_decode()

    async def _with_prefill_logprobs(
        self, prefill_t: asyncio.Task[Reply], body: bytes, merge: Callable[[bytes, bytes], bytes]
    ) -> bytes:
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                prefill = await asyncio.shield(prefill_t)
            return merge(prefill.body, body)
        except (UpstreamError, TimeoutError, ValueError) as exc:
            logger.warning("could not merge prefill input logprobs", extra={"error": str(exc)})
            return body

    def _watch_prefill(self, prefill_t: asyncio.Task[Reply]) -> None:
        """Prefill legs that outlive decode's answer: retrieve their outcome so no error is lost."""

        def record(task: asyncio.Future[Reply]) -> None:
            if not task.cancelled() and isinstance(exc := task.exception(), UpstreamError):
                self.legs.failed(exc)

        if prefill_t.done():
            record(prefill_t)
        else:
            prefill_t.add_done_callback(record)


def _with_fields(bodies: PDBodies, extra: dict[str, Any]) -> PDBodies:
    """`bodies` with `extra`'s fields set in the decode leg's JSON object (a client's own replaced)."""
    decode = orjson.loads(bodies.decode)
    decode.update(extra)
    return dataclasses.replace(bodies, decode=orjson.dumps(decode))


class StreamMover:
    """Moves a streamed request whose decode failed to another pair (relay.Mover, migration.py):
    at most `migration_limit` times, never back to a decode that failed it."""

    __slots__ = ("disconnect", "endpoint", "failed", "migration", "pair", "proxy", "rid", "worker")

    def __init__(
        self,
        proxy: PDProxy,
        endpoint: str,
        rid: str,
        migration: Migration,
        pair: Pair,
        disconnect: asyncio.Future[None],
    ) -> None:
        self.proxy, self.endpoint, self.rid, self.migration = proxy, endpoint, rid, migration
        self.pair, self.worker, self.disconnect = pair, pair.decode, disconnect
        self.failed: list[Worker] = []

    async def move(self, error: UpstreamError) -> tuple[Reply, PairStreamOutcome] | None:
        legs, metrics = self.proxy.legs, self.proxy.legs.metrics
        self.failed.append(self.worker)
        # The failed decode may be alive (ejected for a stall): it must drop the request.
        legs.abort(self.worker, self.pair.bodies.rids)
        if self.migration.moves >= self.proxy.config.migration_limit:
            metrics.migrations.labels("limit").inc()
            return None
        payload = self.migration.resume_payload()
        if payload is None:
            metrics.migrations.labels("not_resumable").inc()
            return None
        started = time.perf_counter()
        rid = f"{self.rid}.m{self.migration.moves + 1}"
        extra = {"tokens": len(self.migration.ids), "from": self.worker.url, "error": str(error)}
        try:
            pair, reply, prefill_t = await self.proxy._attempts(
                self.endpoint, payload, rid, legs.open_stream, self.disconnect, Timing(started),
                exclude=self.failed, decode_extra=self.migration.decode_extra(),
            )  # fmt: skip
        except (ApiError, UpstreamError, ClientGone) as exc:
            metrics.migrations.labels("failed").inc()
            logger.warning("stream could not move to another pair", extra={**extra, "reason": str(exc)})
            return None
        if reply.stream is None:  # refused (4xx): the continuation is not servable
            metrics.migrations.labels("failed").inc()
            logger.warning("stream could not move: the new decode refused it", extra={**extra, "status": reply.status})
            return None
        self.proxy._watch_prefill(prefill_t)
        self.migration.moved()
        self.pair, self.worker = pair, pair.decode
        metrics.migrations.labels("migrated").inc()
        metrics.migration_seconds.observe(time.perf_counter() - started)
        logger.warning("stream moved to another pair", extra={**extra, "to": pair.decode.url})
        return reply, PairStreamOutcome(legs, pair)


def _release_unless_streaming(reservation: Reservation, task: asyncio.Task[Reply]) -> None:
    """The decode leg's task ended: its reservation ends with it, unless it opened a stream (whose
    owner releases it when the stream closes)."""
    if not finished_ok(task) or task.result().stream is None:
        reservation.release_decode()


async def _prefill_answer_for(timing: Timing, prefill_t: asyncio.Task[Reply]) -> None:
    """Where the client asked for the breakdown, wait (at most PREFILL_ANSWER_WAIT_S) for the
    prefill's answer, which says where its forward pass ended: in sglang the decode's first token and
    the prefill's answer follow the same KV-transfer event, in either order
    (srt/disaggregation/prefill.py, decode.py), and without the answer the transfer would count in
    `prefill`. Requests that did not ask are not held."""
    if timing.wanted and not prefill_t.done():
        await asyncio.wait({prefill_t}, timeout=PREFILL_ANSWER_WAIT_S)


def _headers(ids: RequestIds, timing: Timing, body: bytes) -> dict[str, str]:
    """The answer's headers: its ids, and the TTFT breakdown when the client asked (timing.py)."""
    timing.answered = time.perf_counter()
    headers = ids.headers
    if timing.wanted:
        headers["server-timing"] = timing.server_timing(body)
    return headers


def _refused(reply: Reply, ids: RequestIds) -> Response:
    """An engine's own refusal (4xx), in the one OpenAI error shape."""
    body = normalize_error_body(reply.status, reply.body)
    return Response(body, status_code=reply.status, media_type="application/json", headers=ids.headers)


def _timeout_error(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"The workers did not answer within the request timeout of {seconds:g} s; "
        "retry, or raise --request-timeout if such requests are expected.",
        code="upstream_timeout",
    )


def _gave_up(error: UpstreamError, attempts: int) -> ApiError:
    # The worker's URL and the error text stay in the router's log (with the request id): the
    # client learns what happened, not the cluster's internal addresses.
    logger.warning(
        "request failed on every attempt",
        extra={"attempts": attempts, "worker": error.worker.url, "role": error.worker.role, "error": str(error)},
    )
    if isinstance(error, UpstreamBusy):
        return ApiError(
            error.status,
            f"The {error.worker.role} workers are full (they answered {error.status} to the request "
            f"{attempts} time(s)). Retry after the Retry-After delay.",
            code="worker_busy",
            headers={"retry-after": error.retry_after},
        )
    timed_out = isinstance(error, UpstreamTimeout)
    what = "did not answer in time" if timed_out else "failed"
    return ApiError(
        504 if timed_out else 502,
        f"The request failed after {attempts} attempt(s): the {error.worker.role} worker {what}. "
        "Retry later; the router's log has the details under this request id.",
        code="upstream_error",
    )
