"""PD orchestration: pick a (prefill, decode) pair, add the bootstrap fields, send the same body to
both at once, answer with decode's response (relaying SSE chunk by chunk), retry on another pair
while nothing has reached the client, and abort the other leg whenever one leg is given up.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .config import RouterConfig
from .errors import ApiError, sse_error
from .exceptions import (
    NoHealthyWorker,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    map_client_exceptions,
)
from .log import logger
from .metrics import RouterMetrics
from .policies import Policy, RoutingRequest
from .upstream import UpstreamPool, make_timeouts
from .validation import batch_size, routing_text
from .workers import Worker, WorkerRegistry

__all__ = ["PDProxy"]

_MAX_ROOM = 2**63 - 1
_BLAME_GRACE_S = 0.1


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass(slots=True)
class Pair:
    prefill: Worker
    decode: Worker
    prefill_body: bytes
    decode_body: bytes
    rids: list[str]
    dp_ranks: list[int]


@dataclass(slots=True)
class Leg:
    """The answer of one worker leg; body is read fully unless `stream` is set."""

    status: int
    content_type: str
    body: bytes = b""
    stream: aiohttp.ClientResponse | None = None


class PDProxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        prefill_policy: Policy,
        decode_policy: Policy,
        *,
        worker_api_key: str = "",
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self._headers = {"content-type": "application/json"}
        if worker_api_key:
            self._headers["authorization"] = f"Bearer {worker_api_key}"
        self.timeouts = make_timeouts(
            connect_s=config.connect_timeout_s,
            request_s=config.request_timeout_s,
            stream_idle_s=config.stream_idle_timeout_s,
            health_s=config.health_timeout_s,
        )
        self.pool = UpstreamPool()
        self._background: set[asyncio.Task[Any]] = set()
        self._rng = random.Random()
        self._dp_counter = itertools.count()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=3.0)
        await self.pool.aclose()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- pair selection -----------------------------------------------------------------------

    def _pick(self, endpoint: str, payload: dict[str, Any], rid: str, exclude: list[Worker]) -> Pair:
        prefills = self.registry.available("prefill", exclude)
        if not prefills:
            raise NoHealthyWorker("prefill")
        decodes = self.registry.available("decode", exclude)
        if not decodes:
            raise NoHealthyWorker("decode")
        request = RoutingRequest(
            text=routing_text(payload) if self.prefill_policy.needs_text or self.decode_policy.needs_text else ""
        )
        prefill = self.prefill_policy.select(prefills, request)
        decode = self.decode_policy.select(decodes, request)
        n = batch_size(endpoint, payload)
        count = 1 if n is None else n
        rooms: list[int] = []
        dp_ranks: list[int] = []
        for _ in range(count):
            room = self._rng.randint(0, _MAX_ROOM)
            if prefill.dp_size > 1:
                # Decode finds the prefill DP rank as bootstrap_room % dp_size (REFERENCE.md §2),
                # so the room must agree with the rank we route to: the least-loaded one.
                start = next(self._dp_counter)
                rank = min(
                    ((start + i) % prefill.dp_size for i in range(prefill.dp_size)),
                    key=prefill.dp_in_flight.__getitem__,
                )
                prefill.dp_in_flight[rank] += 1
                room -= room % prefill.dp_size
                room += rank
                if room > _MAX_ROOM:
                    room -= prefill.dp_size
                dp_ranks.append(rank)
            rooms.append(room)
        body = dict(payload)
        if n is None:
            rids = [rid]
            body["bootstrap_host"] = prefill.bootstrap_host
            body["bootstrap_port"] = prefill.bootstrap_port
            body["bootstrap_room"] = rooms[0]
            body["rid"] = rid
        else:
            rids = [f"{rid}-{i}" for i in range(n)]
            body["bootstrap_host"] = [prefill.bootstrap_host] * n
            body["bootstrap_port"] = [prefill.bootstrap_port] * n
            body["bootstrap_room"] = rooms
            body["rid"] = rids
        decode_body = orjson.dumps(body)
        if dp_ranks:
            body["routed_dp_rank"] = dp_ranks[0] if n is None else dp_ranks
            prefill_body = orjson.dumps(body)
        else:
            prefill_body = decode_body
        return Pair(prefill, decode, prefill_body, decode_body, rids, dp_ranks)

    # -- one leg --------------------------------------------------------------------------------

    def _begin(self, worker: Worker) -> None:
        worker.breaker.on_dispatch()
        worker.in_flight += 1

    def _end(self, worker: Worker) -> None:
        worker.in_flight -= 1

    def _failed(self, exc: UpstreamError) -> None:
        worker = exc.worker
        worker.breaker.record_failure()
        worker.last_error = str(exc)
        kind = (
            "timeout"
            if isinstance(exc, UpstreamTimeout)
            else ("status" if isinstance(exc, UpstreamStatusError) else "unreachable")
        )
        self.metrics.upstream_errors.labels(worker.role, kind).inc()
        self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))
        logger.warning(
            "worker leg failed",
            extra={"worker": worker.url, "role": worker.role, "error": str(exc), "kind": kind},
        )

    def _succeeded(self, worker: Worker) -> None:
        if worker.breaker.failures or worker.breaker.state:
            worker.breaker.record_success()
            self.metrics.breaker_state.labels(worker.role, worker.url).set(0)

    async def _unary_leg(self, worker: Worker, path: str, body: bytes, rid: str) -> Leg:
        self._begin(worker)
        try:
            with map_client_exceptions(worker, f"POST {path}"):
                async with self.pool.session.post(
                    worker.url + path,
                    data=body,
                    headers={**self._headers, "x-request-id": rid},
                    timeout=self.timeouts.unary,
                ) as resp:
                    content = await resp.read()
            leg = Leg(resp.status, resp.headers.get("content-type", "application/json"), content)
            if resp.status >= 500:
                raise UpstreamStatusError(
                    f"POST {path} to {worker.role} worker {worker.url} answered {resp.status}: {content[:200]!r}",
                    worker,
                    resp.status,
                    content,
                )
            self._succeeded(worker)
            return leg
        finally:
            self._end(worker)

    async def _open_stream(self, worker: Worker, path: str, body: bytes, rid: str) -> Leg:
        """Send the decode leg and wait for its first body chunk. The worker's in-flight count
        stays raised until RelayResponse finishes the stream."""
        self._begin(worker)
        resp: aiohttp.ClientResponse | None = None
        try:
            with map_client_exceptions(worker, f"POST {path}"):
                resp = await self.pool.session.post(
                    worker.url + path,
                    data=body,
                    headers={**self._headers, "x-request-id": rid},
                    timeout=self.timeouts.stream,
                )
                content_type = resp.headers.get("content-type", "text/event-stream")
                if resp.status >= 400:
                    content = await resp.read()
                    resp.release()
                    if resp.status >= 500:
                        raise UpstreamStatusError(
                            f"POST {path} to decode worker {worker.url} answered {resp.status}: {content[:200]!r}",
                            worker,
                            resp.status,
                            content,
                        )
                    self._succeeded(worker)
                    self._end(worker)
                    return Leg(resp.status, content_type, content)
                first = await resp.content.readany()
            if first[:24].replace(b" ", b"").startswith(b'data:{"error"'):
                # sglang reports a failed KV transfer as the stream's first event: nothing has
                # reached the client yet, so this attempt can still be retried.
                raise UpstreamStatusError(
                    f"decode worker {worker.url} answered the stream with an error: {first[:300]!r}",
                    worker,
                    502,
                    first,
                )
            return Leg(resp.status, content_type, first, stream=resp)
        except BaseException:
            if resp is not None:
                resp.close()
            self._end(worker)
            raise

    def _abort(self, worker: Worker, rids: list[str]) -> None:
        """Tell a worker to drop a request (fire and forget, bounded by a short timeout)."""
        self.metrics.aborts.labels(worker.role).inc()

        async def send() -> None:
            for rid in rids:
                try:
                    async with self.pool.session.post(
                        worker.url + "/abort_request",
                        data=orjson.dumps({"rid": rid}),
                        headers=self._headers,
                        timeout=self.timeouts.abort,
                    ) as resp:
                        await resp.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    logger.info("abort_request failed", extra={"worker": worker.url, "rid": rid, "error": str(exc)})

        self.spawn(send())

    # -- orchestration ------------------------------------------------------------------------

    async def _attempts(
        self,
        endpoint: str,
        payload: dict[str, Any],
        rid: str,
        open_decode: Callable[[Worker, str, bytes, str], Awaitable[Leg]],
        receive: Receive,
    ) -> tuple[Pair, Leg, asyncio.Task[Leg]]:
        """Run attempts until decode gives an answer (or its first chunk). Returns the pair,
        decode's leg and the prefill task (possibly still running)."""
        exclude: list[Worker] = []
        last_error: UpstreamError | None = None
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            for attempt in range(self.config.max_retries + 1):
                if attempt:
                    delay = min(self.config.retry_max_backoff_s, self.config.retry_backoff_s * 2 ** (attempt - 1))
                    await asyncio.sleep(delay * (0.5 + self._rng.random()))
                # Each attempt gets its own rid: an abort sent for a failed attempt must not hit
                # the retry, and sglang refuses a rid that is still in flight.
                attempt_rid = rid if attempt == 0 else f"{rid}.{attempt}"
                try:
                    pair = self._pick(endpoint, payload, attempt_rid, exclude)
                except NoHealthyWorker as exc:
                    if last_error is not None:
                        raise _gave_up(last_error, attempt) from exc
                    raise ApiError(503, str(exc), code="no_healthy_worker", headers={"retry-after": "1"}) from exc
                prefill_t = asyncio.ensure_future(
                    self._unary_leg(pair.prefill, endpoint, pair.prefill_body, attempt_rid)
                )
                if pair.dp_ranks:
                    prefill_t.add_done_callback(partial(_release_ranks, pair.prefill, pair.dp_ranks))
                decode_t = asyncio.ensure_future(open_decode(pair.decode, endpoint, pair.decode_body, attempt_rid))
                try:
                    outcome = await self._race(pair, prefill_t, decode_t, disconnect, deadline)
                except BaseException:
                    _cancel(prefill_t, decode_t)
                    self._abort_unfinished(pair, prefill_t, decode_t)
                    raise
                if isinstance(outcome, Leg):
                    return pair, outcome, prefill_t
                last_error = outcome
                exclude.append(outcome.worker)
                self.metrics.retries.labels(outcome.worker.role).inc()
            assert last_error is not None
            raise _gave_up(last_error, self.config.max_retries + 1)
        finally:
            disconnect.cancel()

    async def _race(
        self,
        pair: Pair,
        prefill_t: asyncio.Task[Leg],
        decode_t: asyncio.Task[Leg],
        disconnect: asyncio.Future[None],
        deadline: float,
    ) -> Leg | UpstreamError:
        """Wait for decode's answer while watching prefill and the client. Returns the answer
        (decode's, or prefill's own 4xx refusal), or the leg error that makes this attempt worth
        retrying on another pair."""
        pending: set[asyncio.Future[Any]] = {prefill_t, decode_t, disconnect}
        loop = asyncio.get_running_loop()
        while True:
            timeout = deadline - loop.time()
            if timeout <= 0:
                raise _timeout_error(self.config.request_timeout_s)
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise _timeout_error(self.config.request_timeout_s)
            if disconnect in done:
                raise ClientGone()
            if prefill_t in done and prefill_t in pending:
                pending.discard(prefill_t)
                exc = prefill_t.exception()
                if exc is not None or prefill_t.result().status >= 400:
                    if decode_t.done() and decode_t.exception() is None:
                        return decode_t.result()  # decode answered; prefill's failure no longer matters
                    _cancel(decode_t)
                    self._abort(pair.decode, pair.rids)
                    if isinstance(exc, UpstreamError):
                        self._failed(exc)
                        return exc
                    if exc is not None:
                        raise exc
                    # The engine refused the request itself (4xx): retrying will not help.
                    return prefill_t.result()
            if decode_t in done:
                exc = decode_t.exception()
                if exc is None:
                    leg = decode_t.result()
                    if leg.status >= 400 and not prefill_t.done():
                        _cancel(prefill_t)
                        self._abort(pair.prefill, pair.rids)
                    return leg
                if isinstance(exc, UpstreamStatusError) and not prefill_t.done():
                    # Decode answered with an error: a dying prefill (failed KV transfer) is the
                    # usual cause, and its connection error is due within moments.
                    await asyncio.wait({prefill_t}, timeout=_BLAME_GRACE_S)
                prefill_exc = prefill_t.exception() if prefill_t.done() and not prefill_t.cancelled() else None
                if not prefill_t.done():
                    _cancel(prefill_t)
                    self._abort(pair.prefill, pair.rids)
                if isinstance(exc, UpstreamError):
                    if isinstance(exc, UpstreamStatusError) and isinstance(prefill_exc, UpstreamError):
                        self._failed(prefill_exc)  # the prefill's fault, not the decode's
                        return prefill_exc
                    self._failed(exc)
                    return exc
                raise exc

    def _abort_unfinished(self, pair: Pair, prefill_t: asyncio.Task[Leg], decode_t: asyncio.Task[Leg]) -> None:
        # The request is given up (client gone, deadline passed): both legs get /abort_request,
        # a finished prefill too, since the decode may still be pulling its KV cache.
        self._abort(pair.prefill, pair.rids)
        self._abort(pair.decode, pair.rids)
        if _finished_ok(decode_t) and (opened := decode_t.result().stream) is not None:
            opened.close()
            self._end(pair.decode)

    def _watch_prefill(self, prefill_t: asyncio.Task[Leg]) -> None:
        """Prefill legs that outlive decode's answer: retrieve their outcome so no error is lost."""

        def record(task: asyncio.Future[Leg]) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if isinstance(exc, UpstreamError):
                self._failed(exc)

        if prefill_t.done():
            record(prefill_t)
        else:
            prefill_t.add_done_callback(record)

    async def unary(self, endpoint: str, payload: dict[str, Any], rid: str, receive: Receive) -> Response:
        _pair, leg, prefill_t = await self._attempts(endpoint, payload, rid, self._unary_leg, receive)
        body = leg.body
        if leg.status < 300 and _wants_input_logprobs(endpoint, payload):
            try:
                prefill_leg = await asyncio.wait_for(asyncio.shield(prefill_t), self.config.request_timeout_s)
                body = _merge_logprobs(prefill_leg.body, body)
            except (UpstreamError, TimeoutError, ValueError) as exc:
                logger.warning("could not merge prefill input logprobs", extra={"error": str(exc)})
        self._watch_prefill(prefill_t)
        return Response(body, status_code=leg.status, media_type=leg.content_type, headers={"x-request-id": rid})

    async def stream(self, endpoint: str, payload: dict[str, Any], rid: str, receive: Receive) -> Response:
        pair, leg, prefill_t = await self._attempts(endpoint, payload, rid, self._open_stream, receive)
        if leg.stream is None:  # decode refused (4xx): answer as is
            self._watch_prefill(prefill_t)
            return Response(
                leg.body, status_code=leg.status, media_type=leg.content_type, headers={"x-request-id": rid}
            )
        first = leg.body
        if _wants_input_logprobs(endpoint, payload):
            try:
                prefill_leg = await asyncio.wait_for(asyncio.shield(prefill_t), self.config.request_timeout_s)
                first = _merge_first_event(prefill_leg.body, first)
            except (UpstreamError, TimeoutError, ValueError) as exc:
                logger.warning("could not merge prefill input logprobs", extra={"error": str(exc)})
        self._watch_prefill(prefill_t)
        return RelayResponse(self, pair, leg, first, rid)


class RelayResponse(Response):
    """Relays decode's SSE stream chunk by chunk. A decode failure mid-stream becomes an SSE error
    event in OpenAI's shape followed by `[DONE]`; a client disconnect aborts both legs."""

    media_type = "text/event-stream"

    def __init__(self, proxy: PDProxy, pair: Pair, leg: Leg, first: bytes, rid: str) -> None:
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = leg.status
        self.media_type = leg.content_type
        self.background = None
        self.init_headers({"x-request-id": rid, "cache-control": "no-cache", "x-accel-buffering": "no"})
        self.proxy = proxy
        self.pair = pair
        self.leg = leg
        self.first = first
        self.finished = False
        self.on_done: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        listen = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({relay, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not relay.done():
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            listen.cancel()
            self._close()
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()  # type: ignore[misc]

    async def _relay(self, send: Send) -> None:
        decode = self.pair.decode
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.first:
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
        upstream = self.leg.stream
        assert upstream is not None
        try:
            with map_client_exceptions(decode, "streaming the answer"):
                while chunk := await upstream.content.readany():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.finished = True
            self.proxy._succeeded(decode)
        except UpstreamError as exc:
            self.finished = True
            self.proxy._failed(exc)
            # Nothing can be retried once bytes reached the client: end the stream cleanly.
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error(
                        502,
                        f"The decode worker failed mid-stream ({exc}); the answer is incomplete. Retry the request.",
                        code="upstream_stream_error",
                    ),
                    "more_body": True,
                }
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _close(self) -> None:
        if self.leg.stream is not None:
            # A finished stream goes back to the pool; an unfinished one closes its connection.
            if self.finished:
                self.leg.stream.release()
            else:
                self.leg.stream.close()
        if not self.finished:
            # The client went away (or sending failed): stop both legs.
            self.proxy._abort(self.pair.decode, self.pair.rids)
            self.proxy._abort(self.pair.prefill, self.pair.rids)
        self.proxy._end(self.pair.decode)
        if self.on_done is not None:
            self.on_done()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _release_ranks(worker: Worker, ranks: list[int], _: asyncio.Future[Any]) -> None:
    if len(worker.dp_in_flight) == worker.dp_size:  # unchanged since the pick
        for rank in ranks:
            if rank < worker.dp_size:
                worker.dp_in_flight[rank] = max(0, worker.dp_in_flight[rank] - 1)


def _cancel(*tasks: asyncio.Future[Any]) -> None:
    """Cancel unfinished legs and retrieve every outcome: a leg that turns its cancellation into
    an error (a client timeout racing the cancel) must not log "exception was never retrieved"."""
    for task in tasks:
        if not task.done():
            task.cancel()
            task.add_done_callback(_consume)
        else:
            _consume(task)


def _finished_ok(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _timeout_error(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"The workers did not answer within the request timeout of {seconds:g} s; "
        "retry, or raise --request-timeout if such requests are expected.",
        code="upstream_timeout",
    )


def _gave_up(error: UpstreamError, attempts: int) -> ApiError:
    status = 504 if isinstance(error, UpstreamTimeout) else 502
    return ApiError(
        status,
        f"The request failed after {attempts} attempt(s); last error: {error}. "
        "Check the workers' health with GET /workers.",
        code="upstream_error",
    )


def _wants_input_logprobs(endpoint: str, payload: dict[str, Any]) -> bool:
    return endpoint == "/generate" and bool(payload.get("return_logprob"))


def _merge_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    """decode.meta_info.input_token_logprobs = prefill's + decode's (sglang's PD convention)."""
    p, d = orjson.loads(prefill_body), orjson.loads(decode_body)
    if isinstance(d, list) and isinstance(p, list):
        for pi, di in zip(p, d, strict=False):
            _merge_one(pi, di)
    elif isinstance(d, dict) and isinstance(p, dict):
        _merge_one(p, d)
    return orjson.dumps(d)


def _merge_one(p: dict[str, Any], d: dict[str, Any]) -> None:
    pl = (p.get("meta_info") or {}).get("input_token_logprobs")
    meta = d.get("meta_info")
    if isinstance(pl, list) and isinstance(meta, dict):
        meta["input_token_logprobs"] = pl + list(meta.get("input_token_logprobs") or [])


def _first_event(body: bytes) -> tuple[bytes, bytes] | None:
    """Split `data: {json}\\n\\n...` into the first event's JSON and the rest."""
    if not body.startswith(b"data: "):
        return None
    end = body.find(b"\n\n")
    if end < 0:
        return None
    return body[6:end], body[end:]


def _merge_first_event(prefill_body: bytes, first: bytes) -> bytes:
    p, d = _first_event(prefill_body), _first_event(first)
    if p is None or d is None or d[0] == b"[DONE]":
        return first
    merged = _merge_logprobs(p[0], d[0])
    return b"data: " + merged + d[1]
