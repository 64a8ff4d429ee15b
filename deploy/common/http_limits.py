"""Limits on each client connection of an HTTP server, enforced in the protocol uvicorn runs per
connection: the router's and the reference engine's ports both serve with it.

An ASGI middleware sees a request only once its whole head has been parsed and held in memory, and
it never sees a connection that sends nothing. So these limits live in a subclass of uvicorn's
httptools protocol instead, where bytes and connections arrive:

- **The request head**: bytes of the request line and of the whole head, and the number of header
  fields, counted as the bytes arrive (before the parser buffers them): 414 or 431.
- **Time**: a complete head within `header_timeout_s` of the connection opening (or of the first
  byte of a keep-alive connection's next request): 408, then the connection closes. The body must
  keep moving: `body_grace_s` after the head, and from then on, at least `body_min_rate` bytes a
  second on average must have arrived (a body of 1 MB at 1 KiB/s passes, a byte a second does not),
  and all of it within `body_timeout_s` of the head, whatever the rate: 408 otherwise. Without
  these a client sending a byte a second, or nothing, holds a descriptor for ever. (uvicorn's
  keep-alive timer covers only the idle time after a response.) nginx's `client_header_timeout`
  and `client_body_timeout` are the same idea (60 s each by default; the body one there is per
  read); Apache's mod_reqtimeout `body=20,MinRate=500` is the rate form used here.
- **Connections**: beyond `max_connections` open at once, a new connection gets 503 with
  Retry-After and is closed at once, so the descriptors never run out: when they did, the kernel
  refused everyone, health checks included, and nothing was logged. One source address may hold at
  most `source_share` of the cap (half by default), so one client opening idle connections cannot
  lock every other client out; beyond that its new connections get the same 503.

Both 503s carry the header `x-sglpd-refused` (`connection-limit` or `source-limit`) besides the
body code `overloaded`: the router's health probe reads it as "this server is up and full", not as
a failed probe (deploy/router/workers/health.py), where a plain 503 from `/health` is sglang's
verdict that the engine is not serving.

A refused connection gets its answer with the OpenAI error body, then is closed a moment later:
closing at once, with the client's bytes unread, makes the kernel reset the connection before the
client has read the answer.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .openai_errors import error_body

__all__ = [
    "DEFAULT_LIMITS",
    "REFUSED_HEADER",
    "ConnectionLimits",
    "LimitedProtocol",
    "limited_protocol",
    "raise_descriptor_limit",
]

logger = logging.getLogger("sglang_pd.http")

_LINGER_S = 0.5
_OVERLOAD_LINGER_S = 0.1  # refused for load: let the 503 out, then free the descriptor quickly
_REASONS = {
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
# Names a 503 for a full server (value: which cap), so a client can tell it from an application's 503.
REFUSED_HEADER = "x-sglpd-refused"
_CODES = {408: "request_timeout", 414: "request_head_too_large", 431: "request_head_too_large", 503: "overloaded"}

# Descriptors kept back from client connections: the router's pooled connections to its workers,
# log and metrics files, the listening sockets.
_RESERVED_DESCRIPTORS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What one connection may take: head size, time to send its head and body, and how many
    connections the server holds open at once (0: as many as descriptors allow), one source
    address at most `source_share` of them (1.0: no share of its own)."""

    max_request_line_bytes: int = 8 * 1024
    max_head_bytes: int = 64 * 1024
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 300.0
    body_grace_s: float = 10.0
    body_min_rate: int = 1024
    max_connections: int = 10_000
    source_share: float = 0.5

    def __post_init__(self) -> None:
        counts = ("max_request_line_bytes", "max_head_bytes", "max_header_count", "max_connections", "body_min_rate")
        for name in counts:
            if getattr(self, name) < 0:
                raise ValueError(f"Connection limit '{name}' is {getattr(self, name)}. It must be >= 0.")
        for name in ("header_timeout_s", "body_timeout_s", "body_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Connection limit '{name}' is {getattr(self, name)}. It must be > 0.")
        if not 0 < self.source_share <= 1:
            raise ValueError(
                f"Connection limit 'source_share' is {self.source_share}. It must be > 0 and <= 1 "
                "(the fraction of the connection cap one source address may hold; 1: no limit of its own)."
            )


DEFAULT_LIMITS = ConnectionLimits()


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; returns the new soft limit.
    Containers often start with 1024 soft and 1,048,576 hard, and each connection is a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit; usable_connections() sizes the cap to it
    return soft


def usable_connections(limits: ConnectionLimits, descriptors: int) -> int:
    """The connection cap that fits `descriptors`: the configured one, at most what is left after
    the reserve (0 configured: all of that)."""
    fits = max(64, descriptors - _RESERVED_DESCRIPTORS)
    return fits if limits.max_connections == 0 else min(limits.max_connections, fits)


def source_cap(limits: ConnectionLimits, cap: int) -> int:
    """How many of the `cap` connections one source address may hold (at least 1)."""
    return max(1, int(cap * limits.source_share))


# Open connections per source address, for each server (its uvicorn ServerState).
_SOURCES: WeakKeyDictionary[object, Counter[str]] = WeakKeyDictionary()


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the protocol answers with its status."""


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` on every connection (`limited_protocol` makes
    the subclass that a server is given)."""

    limits: ConnectionLimits = DEFAULT_LIMITS
    connection_cap: int = DEFAULT_LIMITS.max_connections
    source_connection_cap: int = source_cap(DEFAULT_LIMITS, DEFAULT_LIMITS.max_connections)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._head_done = False
        self._refusal: tuple[int, str] | None = None
        self._refused_by = ""  # which cap refused the connection (the x-sglpd-refused header)
        self._timer: asyncio.TimerHandle | None = None
        self._body_start = 0.0
        self._body_bytes = 0
        self._source = ""
        super().connection_made(transport)
        source = self.client[0] if self.client else ""
        held = _SOURCES.setdefault(self.server_state, Counter())
        if len(self.connections) > self.connection_cap:
            self._refuse_for_load(
                "connection-limit",
                f"The server holds its limit of {self.connection_cap} open connections. Retry shortly, "
                "or reuse a keep-alive connection.",
            )
            return
        if source and held[source] >= self.source_connection_cap:
            self._refuse_for_load(
                "source-limit",
                f"This client's address ({source}) holds its share of {self.source_connection_cap} of the "
                "server's open connections. Retry shortly, or reuse a keep-alive connection.",
            )
            return
        if source:
            held[source] += 1
            self._source = source
        self._arm(self.limits.header_timeout_s, "header")

    def _refuse_for_load(self, cap: str, message: str) -> None:
        self._refused_by = cap
        self._refuse(503, message, log=False)  # a flood would flood the log too; the count is in the 503s
        self._send_refusal(linger_s=_OVERLOAD_LINGER_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._source:
            held = _SOURCES.get(self.server_state)
            if held is not None:
                held[self._source] -= 1
                if held[self._source] <= 0:
                    del held[self._source]
            self._source = ""
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: the connection is closing, ignore what is still arriving
        if not self._head_done:
            # Count only up to the end of the head: the body may follow in the same chunk.
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(
                    431,
                    f"The request's headers are larger than the server's limit of {self.limits.max_head_bytes} bytes.",
                )
                self._send_refusal()
                return
        super().data_received(data)

    # Parser callbacks: raising stops the parser; uvicorn then calls send_400_response.
    def on_message_begin(self) -> None:
        if self._timer is None:
            # A keep-alive connection's next request: its head is on the clock from its first byte.
            self._arm(self.limits.header_timeout_s, "header")
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            self._refuse(
                414,
                f"The request's URL is longer than the server's limit of {self.limits.max_request_line_bytes} bytes.",
            )
            raise _Refused()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if len(self.headers) > self.limits.max_header_count:
            self._refuse(
                431, f"The request has more than the server's limit of {self.limits.max_header_count} header fields."
            )
            raise _Refused()

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._body_start = self.loop.time()
        self._body_bytes = 0
        self._arm_body()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()
        self._head_done = False
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._send_refusal()

    def _arm(self, delay_s: float, part: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, self._timed_out, part, delay_s)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _body_due(self) -> float:
        """When the body is late: the whole-body deadline, or sooner where the bytes so far fall
        below the minimum rate (`body_grace_s` after the head, plus a second per `body_min_rate`
        bytes that arrived)."""
        limits = self.limits
        due = self._body_start + limits.body_timeout_s
        if limits.body_min_rate > 0:
            due = min(due, self._body_start + limits.body_grace_s + self._body_bytes / limits.body_min_rate)
        return due

    def _arm_body(self) -> None:
        # One timer per body, moved on only when it fires: counting bytes costs nothing per chunk.
        self._disarm()
        self._timer = self.loop.call_at(self._body_due(), self._body_check)

    def _body_check(self) -> None:
        self._timer = None
        if self.loop.time() < self._body_due():
            self._arm_body()  # bytes arrived meanwhile: later due
            return
        limits = self.limits
        elapsed = self.loop.time() - self._body_start
        if elapsed >= limits.body_timeout_s:
            self._timed_out("body", limits.body_timeout_s)
            return
        self._timed_out(
            "body",
            elapsed,
            f"The request's body arrives slower than the server's minimum of {limits.body_min_rate} bytes/s "
            f"({self._body_bytes} bytes in {elapsed:.1f} s, {limits.body_grace_s:g} s of them free).",
        )

    def _timed_out(self, part: str, delay_s: float, message: str = "") -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self._refuse(408, message or f"The request's {part} did not arrive within the server's limit of {delay_s:g} s.")
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # an answer is on its way already: only closing is left
            return
        self._send_refusal()

    def _refuse(self, status: int, message: str, *, log: bool = True) -> None:
        self._refusal = (status, message)
        if log:
            logger.warning("request refused", extra={"status": status, "client": self.client, "reason": message})

    def _send_refusal(self, linger_s: float = _LINGER_S) -> None:
        assert self._refusal is not None
        status, message = self._refusal
        advice = " Send a smaller request." if status in (414, 431) else ""
        body = error_body(status, message + advice, code=_CODES[status])
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
        if status == 503:
            head += b"retry-after: 1\r\n"
        if self._refused_by:
            head += b"%s: %s\r\n" % (REFUSED_HEADER.encode(), self._refused_by.encode())
        if self.transport.is_closing():
            return
        self.transport.write(head + b"\r\n" + body)
        if self.cycle is not None:
            # The app may still hold this request: it sees a client that left.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.pause_reading()
        self.loop.call_later(linger_s, self.transport.close)


def limited_protocol(
    limits: ConnectionLimits, base: type[LimitedProtocol] = LimitedProtocol, *, descriptors: int | None = None
) -> type[LimitedProtocol]:
    """The protocol class (what uvicorn's `http=` option takes) enforcing `limits`, its connection
    cap fitted to `descriptors` (default: this process's open-file limit)."""
    if descriptors is None:
        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = usable_connections(limits, descriptors)
    attrs = {"limits": limits, "connection_cap": cap, "source_connection_cap": source_cap(limits, cap)}
    return type(base.__name__, (base,), attrs)
