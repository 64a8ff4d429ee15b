"""The router's connections send a response's head with the bytes that follow it (one send() per
unary answer, not two), and never hold bytes back: a stream's head leaves at the end of the event
loop's turn, and a head written just before close still arrives. Real sockets on loopback; the
writes that reach the real transport are counted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sglang_pd.deploy.router.api.connection import CoalescingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Counted:
    """The real transport, its writes counted."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def serve_once(answer: Callable[[Any], Awaitable[None]], *, coalesce: bool) -> tuple[list[bytes], bytes, float]:
    """A loopback server that answers one connection with `answer(transport)`; returns the writes
    the socket got, the bytes the client read, and when (seconds after connecting) the first arrived."""
    loop = asyncio.get_running_loop()
    counted: list[Counted] = []
    done = loop.create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            real = Counted(transport)
            counted.append(real)
            wrapped = CoalescingTransport(real, loop) if coalesce else real  # type: ignore[arg-type]
            task = asyncio.ensure_future(answer(wrapped))
            task.add_done_callback(lambda t: done.set_result(t.exception()))

    server = await loop.create_server(Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first = await reader.read(1)
    first_at = loop.time() - started
    rest = await asyncio.wait_for(reader.read(), timeout=5)
    assert await done is None
    writer.close()
    server.close()
    return counted[0].writes, first + rest, first_at


async def unary(transport: Any) -> None:
    transport.write(HEAD)
    transport.write(b"{}")
    transport.close()


async def stream(transport: Any) -> None:
    transport.write(HEAD)
    await asyncio.sleep(0.5)  # the first chunk comes later
    transport.write(b"{}")
    transport.close()


async def head_then_close(transport: Any) -> None:
    transport.write(HEAD)
    transport.close()


def test_a_unary_answer_is_one_write() -> None:
    writes, got, _ = asyncio.run(serve_once(unary, coalesce=True))
    assert writes == [HEAD + b"{}"] and got == HEAD + b"{}"
    # The control: uvicorn's two writes, without the coalescing transport.
    writes, got, _ = asyncio.run(serve_once(unary, coalesce=False))
    assert writes == [HEAD, b"{}"] and got == HEAD + b"{}"


def test_a_stream_head_is_not_held_back() -> None:
    writes, got, first_at = asyncio.run(serve_once(stream, coalesce=True))
    assert writes == [HEAD, b"{}"] and got == HEAD + b"{}"
    assert first_at < 0.4, first_at  # the head left at the end of its turn, not with the chunk 0.5 s later


def test_a_head_written_before_close_arrives() -> None:
    writes, got, _ = asyncio.run(serve_once(head_then_close, coalesce=True))
    assert writes == [HEAD] and got == HEAD
