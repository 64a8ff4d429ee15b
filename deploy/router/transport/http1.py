"""A small HTTP/1.1 client for the router's legs to its workers.

Why not a general client: aiohttp's was a third of the router's CPU per request (py-spy on
benchmarks/bench_router.py at concurrency 16: a request object, a header multidict, timer and trace
hooks per request). The router sends a few request shapes to a few workers, so this client does
only that:

- keep-alive connections pooled per origin (scheme, host, port), the warmest reused first;
- the request head and body written in one call;
- answers parsed by httptools (llhttp, the parser uvicorn serves with): Content-Length, chunked,
  or read to the connection's end;
- timeouts as event-loop timers, no task per request;
- the event loop taken from the connection, and the time from `time.monotonic`: on Python 3.11
  `asyncio.get_running_loop()` makes a getpid() system call each time, which was 8 % of the router's
  CPU in a native py-spy profile of benchmarks/bench_router.py (unary, concurrency 16), before this
  and the PD proxy stopped asking for the loop per request;
- reading paused while more than `_HIGH_WATER` bytes of a streamed answer wait for the relay.

A reused connection that the worker closed while it sat idle (uvicorn closes them after its
keep-alive timeout, 5 s by default) fails before any byte of an answer arrives; such a request is
sent once more on a new connection, as Go's net/http does for requests on idle connections
(`errServerClosedIdle`). Any other failure is the caller's to handle.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

__all__ = ["Answer", "ConnectionClosed", "Http1Client", "InvalidAnswer"]

# A streamed answer's bytes waiting for the relay past this point pause reading from the worker
# (TCP flow control then slows the worker), so a slow client cannot make the router buffer a
# fast worker's whole answer.
_HIGH_WATER = 1 << 20

# Idle connections kept per origin; beyond this a released connection is closed.
_MAX_IDLE = 1024

# Origins remembered before those with no reusable connection are forgotten.
_PRUNE_ORIGINS_AT = 256


class ConnectionClosed(ConnectionError):
    """The worker closed the connection (or it broke) before the answer was complete."""


class InvalidAnswer(ConnectionError):
    """The worker's bytes are not a valid HTTP/1.1 answer."""


class Answer:
    """One answer being received: status and content type once its head arrived, then the body
    (all of it with `read`, as it comes with `next_chunk`). Reading waits at most `idle_s` for each
    piece and, for the whole answer, until `deadline` (`time.monotonic`)."""

    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_deadline",
        "_error",
        "_idle_s",
        "_waiter",
        "buffered",
        "content_type",
        "framed",
        "keep_alive",
        "received",
        "refused",
        "status",
    )

    def __init__(self, conn: _Connection, deadline: float | None, idle_s: float | None) -> None:
        self._conn = conn
        self._deadline = deadline
        self._idle_s = idle_s
        self._chunks: list[bytes] = []
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.buffered = 0
        self.status = 0
        self.content_type = ""
        self.keep_alive = False
        self.framed = False  # a Content-Length or Transfer-Encoding says where the body ends
        self.received = False  # any byte of the answer arrived
        self.refused = ""  # x-sglpd-refused: a 503 from a server at its connection cap (common/http_limits.py)

    # -- fed by the connection ------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered in (b"content-length", b"transfer-encoding"):
            self.framed = True
        elif lowered == b"x-sglpd-refused":
            self.refused = value.decode("latin-1")

    def _on_head(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        self._wake()

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        if self.buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _on_complete(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._complete and self._error is None:
            self._error = error
            self._wake()

    # -- read by the caller ---------------------------------------------------------------------

    async def _wait(self) -> None:
        """Wait for the next event of this answer, within the idle and overall limits."""
        loop = self._conn.loop
        timeout = self._idle_s
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            timeout = left if timeout is None else min(timeout, left)
        if timeout is not None and timeout <= 0:
            raise TimeoutError("no answer within the time allowed")
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def head(self) -> None:
        """Wait for the status line and headers."""
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes:
        """The rest of the body."""
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    async def next_chunk(self) -> bytes:
        """What arrived of the body since the last call, waiting for something; b"" at its end."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        if self.buffered > _HIGH_WATER:
            self._conn.resume_reading()
        self.buffered = 0
        return data

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool when it can."""
        self._conn.finish(self, reusable=self._complete and self.keep_alive and self._error is None)

    def close(self) -> None:
        """Give up on the answer: the connection closes (the worker sees the client leave)."""
        self._conn.finish(self, reusable=False)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer within the time allowed"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin, carrying one answer at a time."""

    def __init__(self, pool: _Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.lost = False
        self.idle_since = 0.0

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        answer = self.answer
        if answer is None:
            return
        if answer.status and not answer.framed and exc is None:
            answer._on_complete()  # an answer without Content-Length or chunking ends with the connection
            return
        reason = f": {exc}" if exc else ""
        answer._fail(ConnectionClosed(f"the worker closed the connection before the answer was complete{reason}"))

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes nobody asked for: the connection cannot be trusted again
            self.close()
            return
        answer.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            answer._fail(InvalidAnswer(f"the worker's answer is not valid HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    # -- httptools callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer._on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.answer is not None:
            self.answer._on_head(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._on_body(body)

    def on_message_complete(self) -> None:
        if self.answer is not None:
            self.answer._on_complete()

    # -- used by Answer and the pool ------------------------------------------------------------

    def pause_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    def finish(self, answer: Answer, *, reusable: bool) -> None:
        if self.answer is not answer:
            return  # finished already
        self.answer = None
        if reusable and not self.lost:
            self.pool.put(self)
        else:
            self.close()

    def usable(self) -> bool:
        # The transport can be closed before connection_lost has run (it is called soon after).
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def send(self, message: bytes) -> None:
        """Write a request; a connection that turned out closed raises ConnectionClosed."""
        assert self.transport is not None
        try:
            self.transport.write(message)
        except RuntimeError as exc:  # uvloop: "unable to perform operation on <TCPTransport closed=True>"
            raise ConnectionClosed(f"the connection to the worker was closed: {exc}") from exc

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class _Origin:
    """The idle connections to one scheme://host:port."""

    def __init__(self, url: str, keepalive_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s)://HOST:PORT URL: {url!r}")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc
        self.keepalive_s = keepalive_s
        self.idle: deque[_Connection] = deque()
        self.ssl_context = ssl.create_default_context() if self.tls else None  # loading CAs is slow: once

    def take(self, now: float) -> _Connection | None:
        """The most recently used idle connection still worth reusing, or None."""
        while self.idle:
            conn = self.idle.pop()
            if conn.usable() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def put(self, conn: _Connection) -> None:
        if len(self.idle) >= _MAX_IDLE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    async def connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(
                lambda: _Connection(self, loop),
                self.host,
                self.port,
                ssl=self.ssl_context,
                server_hostname=self.host if self.tls else None,
            )
        return conn

    def unused(self, now: float) -> bool:
        """No idle connection worth keeping (those that are not are closed)."""
        conn = self.take(now)
        if conn is None:
            return True
        self.idle.append(conn)
        return False

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


class Http1Client:
    """Requests over pooled keep-alive HTTP/1.1 connections. `keepalive_s` is how long an idle
    connection is kept: below the workers' own idle timeout (uvicorn's default is 5 s), so that the
    router is usually the side that closes it."""

    def __init__(self, *, keepalive_s: float = 4.0) -> None:
        self.keepalive_s = keepalive_s
        self._origins: dict[str, _Origin] = {}

    async def request(
        self,
        url: str,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_s: float,
        total_s: float | None = None,
        idle_s: float | None = None,
    ) -> Answer:
        """Send a request to the origin `url` and return its answer once the head arrived; the
        caller then reads the body and must `release` or `close` the answer. Raises OSError (the
        worker cannot be reached), ConnectionClosed, InvalidAnswer or TimeoutError."""
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) >= _PRUNE_ORIGINS_AT:
                self._prune(time.monotonic())
            origin = self._origins[url] = _Origin(url, self.keepalive_s)
        deadline = time.monotonic() + total_s if total_s is not None else None
        lines = [f"{method} {path} HTTP/1.1\r\nhost: ", origin.host_header]
        for name, value in headers.items():
            lines.append(f"\r\n{name}: {value}")
        if body or method != "GET":
            lines.append(f"\r\ncontent-length: {len(body)}")
        lines.append("\r\n\r\n")
        message = "".join(lines).encode("latin-1") + body
        conn = origin.take(time.monotonic())
        while True:
            reused = conn is not None
            if conn is None:
                timeout = connect_s if deadline is None else min(connect_s, deadline - time.monotonic())
                conn = await origin.connect(timeout)
            answer = conn.answer = Answer(conn, deadline, idle_s)
            try:
                conn.send(message)
                await answer.head()
                return answer
            except ConnectionClosed:
                conn.finish(answer, reusable=False)
                if reused and not answer.received:
                    conn = None  # closed while idle: once more on a new connection
                    continue
                raise
            except BaseException:
                conn.finish(answer, reusable=False)
                raise

    def _prune(self, now: float) -> None:
        # Workers come and go (Kubernetes gives a new pod a new address): forget the origins
        # with nothing left to reuse, so their number stays bounded.
        for url in [url for url, origin in self._origins.items() if origin.unused(now)]:
            del self._origins[url]

    def close(self) -> None:
        """Close every idle connection; connections carrying answers close as those finish."""
        for origin in self._origins.values():
            origin.close()
        self._origins.clear()
