"""Each client connection is held to its limits by the HTTP protocol (deploy/common/http_limits.py), over
real HTTP on loopback: heads over the limits get 414 / 431 before auth and before the body is read;
slow or silent heads and slow bodies get 408 within their timeout; connections beyond the cap get
503 at once; the router keeps serving others meanwhile."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from ..conftest import Cluster, RunningRouter

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

API_KEY = "sk-head-limits"


@pytest.fixture(scope="module")
def guarded(cluster_1p1d: Cluster) -> Iterator[RunningRouter]:
    config = cluster_1p1d.config(
        api_keys=(API_KEY,), max_header_bytes=16 * 1024, max_header_count=40, max_request_line_bytes=2048
    )
    with cluster_1p1d.serve(config) as running:
        yield running


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send a raw request (no auth) and read the whole answer: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.find(b"\r\n\r\n") + 4 + _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _assert_refused(status: int, headers: dict[str, str], body: bytes, expected: int) -> None:
    assert status == expected
    assert headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_head_too_large"


def test_too_many_headers_is_431_before_auth(guarded: RunningRouter) -> None:
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(41))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + fields + b"content-length: 2\r\n\r\n"
    _assert_refused(*_raw(guarded.port, head, b"{}"), 431)


def test_one_huge_header_is_431(guarded: RunningRouter) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n"
    _assert_refused(*_raw(guarded.port, head), 431)


def test_long_url_is_414(guarded: RunningRouter) -> None:
    head = b"GET /v1/models?" + b"q" * 4000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    _assert_refused(*_raw(guarded.port, head), 414)


def test_a_large_body_is_not_a_large_head(guarded: RunningRouter) -> None:
    # 20 KB of body, more than the 16 KB head limit, in the same packets as the head: only the head
    # counts. (At 6 bytes a token it stays within the 4,096-token context the router now checks first.)
    content = orjson.dumps({"messages": [{"role": "user", "content": "x" * 20_000}], "max_tokens": 1})
    resp = httpx.post(
        guarded.url + "/v1/chat/completions", content=content, headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert resp.status_code == 200, resp.text


def test_keep_alive_requests_each_get_their_own_head_budget(guarded: RunningRouter) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", **{f"x-pad-{i}": "p" * 300 for i in range(30)}}
    with httpx.Client(base_url=guarded.url, headers=headers) as client:
        for _ in range(5):  # 5 × ~10 KB of head on one connection, each under the 16 KB limit
            assert client.get("/v1/models").status_code == 200


def test_slow_huge_header_is_cut_off_while_others_are_served(guarded: RunningRouter) -> None:
    """A client trickling an endless header is refused at the limit, not buffered; /health stays fast."""
    outcome: dict[str, object] = {}

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            sent = 0
            try:
                while sent < 10_000_000:
                    sock.sendall(b"a" * 4096)
                    sent += 4096
                    time.sleep(0.001)
            except OSError:
                pass
            outcome["sent"] = sent

    thread = threading.Thread(target=trickle)
    thread.start()
    for _ in range(10):
        started = time.monotonic()
        assert httpx.get(guarded.url + "/health").status_code == 200
        assert time.monotonic() - started < 0.5
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert int(outcome["sent"]) < 2_000_000, "the router stopped reading soon after the limit"  # type: ignore[call-overload]


# A router with short clocks and a small connection cap, so that the tests take seconds.
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 60


@pytest.fixture(scope="module")
def timed(cluster_1p1d: Cluster) -> Iterator[RunningRouter]:
    config = cluster_1p1d.config(
        header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S, max_connections=MAX_CONNECTIONS
    )
    with cluster_1p1d.serve(config) as running:
        yield running


def _connect_from(source: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), source_address=(source, 0))


def _answer_or_close(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sends until it closes `sock` (at most `limit_s`), and when it closed."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - started


def _chat_ok(url: str) -> float:
    started = time.monotonic()
    resp = httpx.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    assert resp.status_code == 200, resp.text
    return time.monotonic() - started


def test_silent_and_slow_heads_are_cut_with_408_within_the_header_timeout(timed: RunningRouter) -> None:
    # From two addresses: one address may hold only half the cap (the per-source share).
    silent = [_connect_from("127.0.0.1", timed.port) for _ in range(20)]
    slow = [_connect_from("127.0.0.2", timed.port) for _ in range(20)]
    for sock in slow:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-a: ")

    def trickle() -> None:  # a byte a second on each slow head, as the attack sent them
        for _ in range(4):
            time.sleep(0.5)
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")

    thread = threading.Thread(target=trickle)
    thread.start()
    assert _chat_ok(timed.url) < 1.0  # others are served meanwhile
    for sock in silent + slow:
        data, closed_after = _answer_or_close(sock, 5.0)
        assert data.startswith(b"HTTP/1.1 408 "), data[:80]
        assert b'"code":"request_timeout"' in data
        assert closed_after < HEADER_TIMEOUT_S + 1.5
        sock.close()
    thread.join()


def test_a_slow_body_is_cut_with_408_within_the_body_timeout(timed: RunningRouter) -> None:
    with socket.create_connection(("127.0.0.1", timed.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1048576\r\n\r\n{")
        started = time.monotonic()
        for _ in range(3):
            time.sleep(0.4)
            sock.sendall(b" ")
        data, _ = _answer_or_close(sock, 5.0)
    assert data.startswith(b"HTTP/1.1 408 "), data[:80]
    assert time.monotonic() - started < BODY_TIMEOUT_S + 1.5


def test_a_keep_alive_connections_next_head_is_on_the_clock_too(timed: RunningRouter) -> None:
    with socket.create_connection(("127.0.0.1", timed.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        time.sleep(HEADER_TIMEOUT_S + 0.3)  # idle between requests: the keep-alive timer's, not this one
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # a head that never ends
        data, closed_after = _answer_or_close(sock, 5.0)
    assert data.startswith(b"HTTP/1.1 408 ") and closed_after < HEADER_TIMEOUT_S + 1.5


def test_connections_beyond_the_cap_get_503_at_once_and_the_router_recovers(timed: RunningRouter) -> None:
    # Three addresses hold the whole cap between them (one may hold only half of it).
    sources = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    held = [_connect_from(sources[i % 3], timed.port) for i in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        extra = [_connect_from("127.0.0.4", timed.port) for _ in range(20)]
        for sock in extra:
            data, closed_after = _answer_or_close(sock, 3.0)
            assert data.startswith(b"HTTP/1.1 503 "), data[:80]
            assert b"retry-after: 1" in data and b'"code":"overloaded"' in data
            assert b"x-sglpd-refused: connection-limit" in data
            assert closed_after < 1.0
            sock.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert _chat_ok(timed.url) < 1.0


def test_bodies_held_at_once_are_bounded_and_the_budget_comes_back(cluster_1p1d: Cluster) -> None:
    mib = 1024 * 1024
    config = cluster_1p1d.config(max_body_bytes=mib, max_body_bytes_in_flight=2 * mib)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    with cluster_1p1d.serve(config) as running:
        # Two bodies of 1 MiB on their way (declared, not yet sent) take the whole 2 MiB budget.
        senders = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(2)]
        for sock in senders:
            sock.sendall(head + b"content-length: %d\r\n\r\n{" % mib)
        time.sleep(0.3)
        status, headers, body = _raw(running.port, head + b"content-length: %d\r\n\r\n" % mib, b" " * mib)
        assert status == 503 and headers["retry-after"] == "1"
        assert orjson.loads(body)["error"]["code"] == "overloaded"
        too_large = _raw(running.port, head + b"content-length: %d\r\n\r\n" % (mib + 1))
        assert too_large[0] == 413  # refused by its declared length, before a byte of it is read
        for sock in senders:
            sock.close()  # the clients leave: their reservations are released
        time.sleep(0.3)
        assert _chat_ok(running.url) < 1.0
