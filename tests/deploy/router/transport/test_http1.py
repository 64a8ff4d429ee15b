"""The router's HTTP/1.1 client against real sockets: raw asyncio servers on loopback that answer
with exact bytes, so each framing, failure and timeout case is the wire's, not a mock's."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sglang_pd.deploy.router.transport import http1
from sglang_pd.deploy.router.transport.http1 import ConnectionClosed, Http1Client, InvalidAnswer

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMITS = {"connect_s": 2.0, "total_s": 5.0}


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the wire: (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running `handler` per connection; yields its URL and a list that gets
    one entry per accepted connection."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return "asyncio", {"use_uvloop": True}  # the loop the router runs on


def keep_alive(answer: bytes) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()

    return handle


OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


async def test_content_length_answers_reuse_one_connection() -> None:
    client = Http1Client()
    async with server(keep_alive(OK)) as (url, accepted):
        for _ in range(5):
            answer = await client.request(url, "POST", "/x", b"{}", {"content-type": "application/json"}, **LIMITS)
            assert (answer.status, answer.content_type) == (200, "application/json")
            assert await answer.read() == b'{"ok":true}'
            answer.release()
        assert len(accepted) == 1
    client.close()


async def test_the_request_carries_host_headers_and_body() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()

    client = Http1Client()
    async with server(handle) as (url, _):
        answer = await client.request(url, "POST", "/generate", b'{"a":1}', {"x-request-id": "r1"}, **LIMITS)
        await answer.read()
        answer.release()
    head, body = seen[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /generate HTTP/1.1"
    assert f"host: {url.removeprefix('http://')}".encode() in lines
    assert b"x-request-id: r1" in lines and b"content-length: 7" in lines
    assert body == b'{"a":1}'
    client.close()


async def test_chunked_answer_streams_piece_by_piece() -> None:
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata:1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await writer.drain()

    client = Http1Client()
    async with server(handle) as (url, _):
        answer = await client.request(url, "POST", "/s", b"{}", {}, connect_s=2.0, idle_s=5.0)
        assert answer.content_type == "text/event-stream"
        assert await answer.next_chunk() == b"data:1"  # before the rest exists
        release.set()
        assert await answer.next_chunk() == b"data:2"
        assert await answer.next_chunk() == b""
        answer.release()
    client.close()


async def test_an_answer_without_length_ends_with_the_connection() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    client = Http1Client()
    async with server(handle) as (url, _):
        answer = await client.request(url, "GET", "/health", b"", {}, **LIMITS)
        assert await answer.read() == b"all of it"
        answer.release()
    client.close()


async def test_a_reused_connection_closed_before_answering_is_replaced_once() -> None:
    # Each connection answers one request and then closes on the next one without a byte of answer
    # (a worker's idle timeout racing the request): that request goes out again on a new connection.
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)

    client = Http1Client()
    async with server(handle) as (url, accepted):
        for _ in range(3):
            answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
            assert await answer.read() == b'{"ok":true}'
            answer.release()
        assert len(accepted) == 3
    client.close()


async def test_a_pooled_connection_with_a_closed_transport_is_not_reused() -> None:
    # A worker that dies resets its connections: uvloop closes the transport and queues
    # connection_lost, and a request taking the connection in between got uvloop's RuntimeError
    # ("the handler is closed") as a router 500. Such a connection must never leave the pool.
    client = Http1Client()
    async with server(keep_alive(OK)) as (url, accepted):
        answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        await answer.read()
        answer.release()
        pooled = client._origins[url].idle[-1]
        assert pooled.transport is not None
        pooled.transport.abort()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert pooled.lost
        pooled.lost = False  # the state in between: handle closed, connection_lost still queued
        answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        assert await answer.read() == b'{"ok":true}'
        answer.release()
        assert len(accepted) == 2
    client.close()


async def test_a_new_connection_closed_before_answering_is_an_error() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    client = Http1Client()
    async with server(hang_up) as (url, accepted):
        with pytest.raises(ConnectionClosed):
            await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        assert len(accepted) == 1  # not sent twice
    client.close()


async def test_closed_mid_answer_is_an_error_not_a_short_body() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    client = Http1Client()
    async with server(handle) as (url, _):
        answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        with pytest.raises(ConnectionClosed):
            await answer.read()
        answer.close()
    client.close()


async def test_garbage_is_an_invalid_answer() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    client = Http1Client()
    async with server(handle) as (url, _):
        with pytest.raises(InvalidAnswer):
            await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
    client.close()


async def test_nobody_listening_is_an_os_error() -> None:
    client = Http1Client()
    async with server(keep_alive(OK)) as (url, _):
        pass  # closed: the port is free again
    with pytest.raises(OSError):
        await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
    client.close()


async def test_total_and_idle_timeouts() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    async def one_chunk_then_silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    client = Http1Client()
    loop = asyncio.get_running_loop()
    async with server(silent) as (url, _):
        started = loop.time()
        with pytest.raises(TimeoutError):
            await client.request(url, "POST", "/x", b"{}", {}, connect_s=2.0, total_s=0.3)
        assert loop.time() - started < 1.0
    async with server(one_chunk_then_silence) as (url, _):
        answer = await client.request(url, "POST", "/s", b"{}", {}, connect_s=2.0, idle_s=0.3)
        assert await answer.next_chunk() == b"a"
        started = loop.time()
        with pytest.raises(TimeoutError):
            await answer.next_chunk()
        assert loop.time() - started < 1.0
        answer.close()
    client.close()


async def test_a_slow_reader_pauses_the_worker() -> None:
    # 8 MiB offered while nobody reads: the client stops reading near its high-water mark (1 MiB),
    # so the server's writes back up instead of the router buffering everything.
    sent = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8388608\r\n\r\n")
        for _ in range(128):
            writer.write(b"x" * 65536)
            await writer.drain()
        sent.set()

    client = Http1Client()
    async with server(flood) as (url, _):
        answer = await client.request(url, "POST", "/s", b"{}", {}, connect_s=2.0, idle_s=5.0)
        await asyncio.sleep(0.5)
        assert not sent.is_set()
        assert answer.buffered < 4 << 20
        total = 0
        while chunk := await answer.next_chunk():
            total += len(chunk)
        assert total == 8 << 20
        answer.release()
    client.close()


async def test_a_closed_answer_does_not_return_its_connection() -> None:
    client = Http1Client()
    async with server(keep_alive(OK)) as (url, accepted):
        answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        answer.close()
        answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
        assert await answer.read() == b'{"ok":true}'
        answer.release()
        assert len(accepted) == 2
    client.close()


async def test_origins_without_reusable_connections_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "_PRUNE_ORIGINS_AT", 2)

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()  # then the connection closes, as a worker going away does

    client = Http1Client()
    urls = []
    for _ in range(3):
        async with server(answer_once) as (url, _):
            answer = await client.request(url, "POST", "/x", b"{}", {}, **LIMITS)
            await answer.read()
            answer.release()
            urls.append(url)
        await asyncio.sleep(0.05)
    assert list(client._origins) == urls[2:]
    client.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_https_verifies_the_worker_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            while True:
                await read_request(reader)
                writer.write(OK)
                await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    url = f"https://localhost:{srv.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(ssl.SSLCertVerificationError):  # not a certificate this machine trusts
            await Http1Client().request(url, "GET", "/health", b"", {}, **LIMITS)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # now it is
        client = Http1Client()
        answer = await client.request(url, "GET", "/health", b"", {}, **LIMITS)
        assert (answer.status, await answer.read()) == (200, b'{"ok":true}')
        answer.release()
        client.close()
    finally:
        srv.close()
