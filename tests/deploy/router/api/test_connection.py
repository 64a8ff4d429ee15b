"""The router's per-connection protocol under a real uvicorn server on loopback: every request of
a keep-alive connection gets the connection's one "client gone" future, which resolves when the
client closes, also in the middle of a request; ClientWatch uses it and never cancels it."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from sglang_pd.deploy.common.http_limits import ConnectionLimits
from sglang_pd.deploy.router.api.connection import CLIENT_GONE, router_protocol
from sglang_pd.deploy.router.pd.relay import ClientWatch
from tests.support.polling import free_port

REQUEST = b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n"


class App:
    """Answers /quick at once; /slow waits for its client to leave (through ClientWatch)."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[None]] = []
        self.slow_saw_gone = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.futures.append(scope["extensions"][CLIENT_GONE]["future"])
        if scope["path"] == "/slow":
            watch = ClientWatch(scope, receive)
            await asyncio.wait_for(watch.gone, 5)
            watch.stop()
            self.slow_saw_gone.set()
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


async def _serving(app: App) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=router_protocol(ConnectionLimits()), lifespan="off",
                            log_config=None, loop="asyncio")  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(2)


def test_one_future_per_connection_resolved_when_the_client_leaves() -> None:
    async def main() -> None:
        app = App()
        server, task, port = await _serving(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(REQUEST % b"quick")
            assert (await _answer(reader)).endswith(b"ok")
        first, second = app.futures
        assert first is second and not first.done()  # the stopped watch left it alone
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", port)
        other_writer.write(REQUEST % b"quick")
        await _answer(other_reader)
        assert app.futures[2] is not first
        writer.close()
        await asyncio.wait_for(asyncio.shield(first), 5)
        assert not app.futures[2].done()  # another connection's client is still there
        other_writer.close()
        server.should_exit = True
        await task

    asyncio.run(main())


def test_a_client_leaving_mid_request_is_seen_at_once() -> None:
    async def main() -> None:
        app = App()
        server, task, port = await _serving(app)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST % b"slow")
        while not app.futures:
            await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(app.slow_saw_gone.wait(), 2)
        server.should_exit = True
        await task

    asyncio.run(main())
