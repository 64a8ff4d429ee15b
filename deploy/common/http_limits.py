"""Limits on each client connection of an HTTP server, enforced in the protocol uvicorn runs per
connection: the router's and the reference engine's ports both serve with it.

An ASGI middleware sees a request only once its whole head has been parsed and held in memory, and
it never sees a connection that sends nothing. So these limits live in a subclass of uvicorn's
httptools protocol instead, where bytes and connections arrive:

- **The request head**: bytes of the request line and of the whole head, and the number of header
  fields, counted as the bytes arrive (before the parser buffers them): 414 or 431.
- **Time**: a complete head within `header_timeout_s` of the connection opening (or of the first
  byte of a keep-alive connection's next request), and the whole body within `body_timeout_s` of
  the head: 408, then the connection closes. Without these a client sending a byte a second, or
  nothing, holds a descriptor for ever. (uvicorn's keep-alive timer covers only the idle time
  after a response.) nginx's `client_header_timeout` and `client_body_timeout` are the same idea
  (60 s each by default; the body one there is per read).
- **Connections**: beyond `max_connections` open at once, a new connection gets 503 with
  Retry-After and is closed at once, so the descriptors never run out: when they did, the kernel
  refused everyone, health checks included, and nothing was logged.

A refused connection gets its answer with the OpenAI error body, then is closed a moment later:
closing at once, with the client's bytes unread, makes the kernel reset the connection before the
client has read the answer.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .openai_errors import error_body

__all__ = ["DEFAULT_LIMITS", "ConnectionLimits", "LimitedProtocol", "limited_protocol", "raise_descriptor_limit"]

logger = logging.getLogger("sglang_pd.http")

_LINGER_S = 0.5
_OVERLOAD_LINGER_S = 0.1  # refused for load: let the 503 out, then free the descriptor quickly
_REASONS = {
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
_CODES = {408: "request_timeout", 414: "request_head_too_large", 431: "request_head_too_large", 503: "overloaded"}

# Descriptors kept back from client connections: the router's pooled connections to its workers,
# log and metrics files, the listening sockets.
_RESERVED_DESCRIPTORS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What one connection may take: head size, time to send its head and body, and how many
    connections the server holds open at once (0: as many as descriptors allow)."""

    max_request_line_bytes: int = 8 * 1024
    max_head_bytes: int = 64 * 1024
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 10_000

    def __post_init__(self) -> None:
        for name in ("max_request_line_bytes", "max_head_bytes", "max_header_count", "max_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"Connection limit '{name}' is {getattr(self, name)}. It must be >= 0.")
        for name in ("header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Connection limit '{name}' is {getattr(self, name)}. It must be > 0.")


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


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the protocol answers with its status."""


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` on every connection (`limited_protocol` makes
    the subclass that a server is given)."""

    limits: ConnectionLimits = DEFAULT_LIMITS
    connection_cap: int = DEFAULT_LIMITS.max_connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._head_done = False
        self._refusal: tuple[int, str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.connection_cap:
            self._refuse(
                503,
                f"The server holds its limit of {self.connection_cap} open connections. Retry shortly, "
                "or reuse a keep-alive connection.",
                log=False,  # a flood would flood the log too; the count is in the 503s clients see
            )
            self._send_refusal(linger_s=_OVERLOAD_LINGER_S)
            return
        self._arm(self.limits.header_timeout_s, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
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
        self._arm(self.limits.body_timeout_s, "body")
        super().on_headers_complete()

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

    def _timed_out(self, part: str, delay_s: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self._refuse(408, f"The request's {part} did not arrive within the server's limit of {delay_s:g} s.")
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
    return type(base.__name__, (base,), {"limits": limits, "connection_cap": cap})
