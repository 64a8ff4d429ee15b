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

from ...common.http_limits import ConnectionLimits, LimitedProtocol, limited_protocol

__all__ = ["CLIENT_GONE", "RouterProtocol", "router_protocol"]

CLIENT_GONE = "sglang_pd.client_gone"


class RouterProtocol(LimitedProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._gone: asyncio.Future[None] = self.loop.create_future()
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {CLIENT_GONE: {"future": self._gone}}  # ASGI: extensions are dicts

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._gone.done():
            self._gone.set_result(None)
        super().connection_lost(exc)


def router_protocol(limits: ConnectionLimits, *, descriptors: int | None = None) -> type[LimitedProtocol]:
    """The protocol class (what uvicorn's `http=` option takes) enforcing `limits`."""
    return limited_protocol(limits, RouterProtocol, descriptors=descriptors)
