"""The router's HTTP protocol, one instance per client connection: uvicorn's httptools protocol
with the connection limits (`deploy/common/http_limits.py`), plus a future that resolves when the
connection is lost.

Every request on the connection finds that future in its ASGI scope, under
`scope["extensions"][CLIENT_GONE]["future"]`, so watching for a client that leaves takes no task per
request (`relay.ClientWatch`). Reading ASGI's receive() for `http.disconnect` did: a task, an
event and uvicorn's receive() per request, which together were a tenth of the router's samples
in a py-spy profile of benchmarks/bench_router.py's load (unary, concurrency 64).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ...common.http_limits import ConnectionLimits, LimitedProtocol, limited_protocol

__all__ = ["CLIENT_GONE", "CoalescingTransport", "RouterProtocol", "router_protocol"]

CLIENT_GONE = "sglang_pd.client_gone"


class CoalescingTransport:
    """A connection's transport that sends a response's head with the bytes that follow it.

    uvicorn writes a response's status line and headers, then its body, as two writes: two
    send() calls per unary answer, where one does (the head alone is never useful to a client).
    The head (a write that opens with `HTTP/1.1 `) is held until the next write, which goes out
    with it, or until the end of the event loop's turn (a stream's head whose first chunk comes
    later). Bytes are never reordered or dropped: whatever is held leaves before any later write,
    and before the transport closes."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(b"HTTP/1.1 "):
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def writelines(self, data: Iterable[bytes]) -> None:
        self.write(b"".join(data))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> object:  # the rest of the transport's API, as it is
        return getattr(self._transport, name)


class RouterProtocol(LimitedProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._gone: asyncio.Future[None] = self.loop.create_future()
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # ASGI: extensions are dicts. `abort` drops the connection at once, its unsent bytes with it
        # (a close would wait for a reader that takes nothing: relay.py's slow-reader cut).
        self.scope["extensions"] = {CLIENT_GONE: {"future": self._gone, "abort": self._abort}}

    def _abort(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._gone.done():
            self._gone.set_result(None)
        super().connection_lost(exc)


def router_protocol(limits: ConnectionLimits, *, descriptors: int | None = None) -> type[LimitedProtocol]:
    """The protocol class (what uvicorn's `http=` option takes) enforcing `limits`."""
    return limited_protocol(limits, RouterProtocol, descriptors=descriptors)
