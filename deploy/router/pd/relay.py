"""Relay decode's SSE stream to the client chunk by chunk, and report how it ended.

The relay owns the open stream; whoever started it learns the outcome through `StreamOutcome`,
exactly one call per stream: `completed`, `failed` (the decode broke mid-stream: the client gets
an OpenAI-shaped SSE error event and `[DONE]`, since the request cannot start again once bytes
reached the client), or `abandoned` (the client went away, or sending to it failed).

A stream with a `Mover` (a streamed `/generate`, migration.py) is the exception: when its decode
fails before the answer finished, the relay books the failure on that decode's outcome and goes
on with the bytes of another pair that continues the answer; each decode's stream has its own
outcome. Only a stream that cannot move ends with the error event.

A stream is complete once its final event `data: [DONE]` has been relayed, whether or not the
decode's end of body follows before the client hangs up: OpenAI's clients stop reading at
`[DONE]` and may close at once, and sglang sends `[DONE]` only after every choice finished
(`srt/entrypoints/openai/serving_chat.py`, `http_server.py`'s generate stream). Such a client is
no 499, and its finished request gets no `/abort_request`.

A client too slow for its stream is cut: when one chunk has waited `slow_reader_s` to be taken
(the client's socket and the router's buffer full), the relay stops, the connection is dropped
with its unsent bytes, and the stream ends as `abandoned`, which aborts its engines' work. Without
the cut, a reader that takes nothing would hold a decode slot while the decode generates on.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ...common.openai_errors import sse_error
from ..api.connection import CLIENT_GONE
from ..exceptions import UpstreamError, UpstreamTimeout
from ..transport.client import Body, Reply
from ..workers.registry import Worker
from .migration import Migration

__all__ = ["ClientWatch", "Mover", "RelayResponse", "StreamOutcome", "ends_with_done", "openai_finish_reasons"]

# sglang's OpenAI routes report an aborted request (aborted by /abort_request, by the scheduler
# under memory pressure, or for a prompt over the context) as `finish_reason: "abort"`, which is not
# one of OpenAI's values (stop, length, content_filter, tool_calls, function_call) and which strict
# clients refuse. It becomes "length": the one OpenAI value that says the answer was cut short;
# "stop" would tell the client the answer is complete. Done on bytes, and only when the chunk holds
# the word, so the common chunk costs one `in` test.
_ABORT = re.compile(rb'("finish_reason"\s*:\s*)"abort"')
_DONE = b"data: [DONE]"
# How often a stream that can move checks whether its decode was ejected while it waits.
_EJECT_POLL_S = 0.25


def openai_finish_reasons(chunk: bytes) -> bytes:
    """`chunk` (JSON or SSE of an OpenAI route) with sglang's "abort" finish reason mapped to OpenAI's."""
    if b'"abort"' not in chunk:
        return chunk
    return _ABORT.sub(rb'\1"length"', chunk)


def ends_with_done(tail: bytes, chunk: bytes) -> bool:
    """Whether an SSE stream whose bytes so far end with `tail` (its last few) then `chunk` ends
    with the final event `data: [DONE]`; a chunk boundary may split the event."""
    end = chunk.rstrip()
    if len(end) < len(_DONE):
        end = (tail + chunk).rstrip()
    return end.endswith(_DONE)


class StreamOutcome(Protocol):
    def waiting(self) -> None:
        """The relay waits for the worker's next bytes (the stall watchdog's clock runs)."""

    def progressed(self) -> None:
        """Bytes arrived from the worker (the stall watchdog's heartbeat)."""

    def completed(self) -> None:
        """The stream reached its end and the client got all of it."""

    def failed(self, error: UpstreamError) -> None:
        """The worker failed mid-stream; the client got an error event."""

    def abandoned(self) -> None:
        """The client left before the end (or sending to it failed)."""


class Mover(Protocol):
    """Moves a broken stream to another pair (proxy.py); `worker` is the current decode."""

    migration: Migration
    worker: Worker

    async def move(self, error: UpstreamError) -> tuple[Reply, StreamOutcome] | None:
        """The new decode's reply (its first chunk and open stream) and its outcome; None when the
        stream cannot move (limit reached, no pair, the new attempt failed)."""


class RelayResponse(Response):
    """Streams `reply` (its first chunk, possibly rewritten, then the rest) to the client."""

    media_type = "text/event-stream"

    def __init__(
        self,
        reply: Reply,
        first: bytes,
        outcome: StreamOutcome,
        *,
        headers: Mapping[str, str],
        watch: ClientWatch | None = None,
        openai: bool = True,
        mover: Mover | None = None,
        slow_reader_s: float = 0.0,
    ) -> None:
        """`headers`: the answer's own (its request ids). `watch`: the request's watch on the
        client, which the relay takes over (and stops); without one the relay starts its own.
        `mover`: continues the stream on another pair when its decode fails (migration.py).
        `slow_reader_s`: cut a client that has not taken a chunk for this long (0: never)."""
        assert reply.stream is not None, "RelayResponse needs an open stream (WorkerClient.open_stream)"
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = reply.status
        self.media_type = reply.content_type
        self.background = None
        self.init_headers({**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
        self.stream: Body = reply.stream
        self.first = openai_finish_reasons(first) if openai else first
        self.openai = openai  # an OpenAI route: finish reasons are mapped to OpenAI's values
        self.outcome = outcome
        self.mover = mover
        self.watch = watch
        self.finished = False
        self.delivered = False  # the client got `data: [DONE]`: the answer is whole
        self.abandoned = False  # the client left mid-stream: logged and counted as 499
        self.slow_reader_s = slow_reader_s
        self.sending_since = 0.0  # when the chunk being sent was handed over (0: none waits)
        self.cut = False  # the client was too slow and was cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        watch = self.watch if self.watch is not None else ClientWatch(scope, receive)
        try:
            await self._until_done_or_cut(relay, watch, scope)
        finally:
            if not relay.done():
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            watch.stop()
            self._close()
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()  # type: ignore[misc]

    async def _until_done_or_cut(self, relay: asyncio.Future[None], watch: ClientWatch, scope: Scope) -> None:
        """Wait for the relay's end or the client's; with `slow_reader_s`, also watch the chunk in
        hand and cut the client once it has waited that long to be taken."""
        limit = self.slow_reader_s
        poll = min(max(limit / 4, 0.05), 1.0) if limit > 0 else None
        while not (await asyncio.wait({relay, watch.gone}, timeout=poll, return_when=asyncio.FIRST_COMPLETED))[0]:
            if self.sending_since and time.monotonic() - self.sending_since > limit:
                self.cut = True
                abort = ((scope.get("extensions") or {}).get(CLIENT_GONE) or {}).get("abort")
                if abort is not None:
                    abort()
                return

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pending, tail = self.first, b""
        while True:
            try:
                await self._pump(send, pending, tail)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            except UpstreamError as exc:
                if self.delivered:  # the answer is whole; only the decode's end of body went wrong
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                self.outcome.failed(exc)
                moved = await self._move(exc)
                if moved is None:
                    break
                pending, tail = moved, b""
        self.finished = True
        if self.mover is not None and self.mover.migration.finished:
            # Every token reached the client; only the decode's final [DONE] is missing.
            body = _DONE + b"\n\n"
        else:
            # The error text (with the worker's URL) is logged by outcome.failed, not sent.
            message = "The decode worker failed mid-stream; the answer is incomplete. Retry the request."
            body = sse_error(502, message, code="upstream_stream_error")
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _move(self, error: UpstreamError) -> bytes | None:
        """Continue the stream on another pair (migration.py): its first bytes, or None."""
        if self.mover is None or self.mover.migration.finished:
            return None
        moved = await self.mover.move(error)
        if moved is None:
            return None
        reply, self.outcome = moved
        assert reply.stream is not None
        self.stream.close()
        self.stream = reply.stream
        return reply.body

    async def _pump(self, send: Send, first: bytes, tail: bytes) -> None:
        """Relay `first`, then the stream's chunks to its end."""
        waiting, progressed = self.outcome.waiting, self.outcome.progressed
        chunk = first
        while True:
            if self.mover is not None:
                chunk = self.mover.migration.feed(chunk, self.mover.worker)
            if self.openai:
                chunk = openai_finish_reasons(chunk)
            if chunk:
                self.sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sending_since = 0.0
                if not self.delivered:
                    self.delivered = ends_with_done(tail, chunk)
                    tail = chunk[-len(_DONE) :]
            if not self.delivered:  # after [DONE] a late end of body is no stall
                waiting()
            if not (chunk := await self._next()):
                break
            progressed()
        self.finished = True
        self.outcome.completed()

    async def _next(self) -> bytes:
        """The stream's next chunk. A stream that can move also ends when its decode is ejected
        (the stall watchdog, failed health checks): waiting on it longer only delays the move."""
        if self.mover is None:
            return await self.stream.next_chunk()
        worker = self.mover.worker
        read = asyncio.ensure_future(self.stream.next_chunk())
        try:
            while not (await asyncio.wait({read}, timeout=_EJECT_POLL_S))[0]:
                if not worker.healthy:
                    raise UpstreamTimeout(f"decode worker {worker.url} was ejected while a stream waited on it", worker)
            return read.result()
        finally:
            if not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)

    def _close(self) -> None:
        # A finished stream goes back to the pool; an unfinished one closes its connection.
        if self.finished:
            self.stream.release()
            return
        self.stream.close()
        if self.delivered:  # the client left after [DONE] (or the body's end failed): a success
            self.finished = True
            self.outcome.completed()
            return
        self.abandoned = True
        self.outcome.abandoned()


class ClientWatch:
    """`gone` resolves when the client disconnects. Under the router's own HTTP protocol it is the
    connection's future (no task per request: connection.py); under another ASGI server (tests)
    a task that reads receive() for `http.disconnect`. Stop the watch when the request ends."""

    __slots__ = ("_owned", "gone")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        shared = ((scope.get("extensions") or {}).get(CLIENT_GONE) or {}).get("future")
        self._owned = shared is None
        self.gone: asyncio.Future[None] = shared if shared is not None else asyncio.ensure_future(_disconnect(receive))

    def stop(self) -> None:
        if self._owned:  # the connection's own future outlives the request: never cancel it
            self.gone.cancel()


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
