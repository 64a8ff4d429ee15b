"""Request heads over the limits get 414 / 431 from the HTTP protocol, before auth and before the
body is read, over real HTTP on loopback; the router keeps serving others meanwhile."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from .conftest import Cluster, RunningRouter

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
    # 100 KB of body in the same packets as the head: only the head counts.
    content = orjson.dumps({"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 1})
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
