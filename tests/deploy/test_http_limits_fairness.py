"""The connection limits between clients (deploy/common/http_limits.py), against a real server
process on loopback: one source address holding idle connections cannot take the whole connection
cap (a second address is still served), and a body that trickles in below the minimum rate is cut
with 408 long before the whole-body deadline, while a slow but steady body is read to its end."""

from __future__ import annotations

import contextlib
import socket
import time

import orjson
import pytest

from tests.support.capped_server import capped_server

CAP = 8  # the server's connection cap; one address may hold half


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _answer(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sends until it closes `sock`, or until `limit_s` passed."""
    sock.settimeout(limit_s)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _get(port: int, source: str, path: str = "/v1/models") -> bytes:
    with _connect(port, source) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % path.encode())
        return _answer(sock, 5.0)


def _loopback_alias_works() -> bool:
    with contextlib.suppress(OSError), socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return True
    return False


needs_alias = pytest.mark.skipif(not _loopback_alias_works(), reason="127.0.0.2 cannot be bound here")


@needs_alias
def test_one_address_holding_idle_connections_cannot_lock_out_another() -> None:
    with capped_server({"max_connections": CAP, "header_timeout_s": 30.0}) as port:
        # The first client opens as many idle connections as it can: twice the cap.
        held = [_connect(port, "127.0.0.1") for _ in range(2 * CAP)]
        try:
            time.sleep(0.3)
            refused = []
            for sock in held:
                sock.settimeout(0.3)
                with contextlib.suppress(TimeoutError):
                    if data := sock.recv(65536):
                        refused.append(data)
            # Half the cap stays with it; each connection beyond gets 503, marked as the share's.
            assert len(refused) == 2 * CAP - CAP // 2, len(refused)
            for data in refused:
                assert data.startswith(b"HTTP/1.1 503 "), data[:80]
                assert b"retry-after: 1" in data and b"x-sglpd-refused: " in data
                assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "overloaded"
            # The first beyond its share is refused for the share (later ones may meet the whole
            # cap too: a refused connection lingers a moment to deliver its 503).
            assert b"x-sglpd-refused: source-limit" in refused[0], refused[0][:300]
            # The second client, from another address, is served while the first holds its share.
            answer = _get(port, "127.0.0.2")
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            # Its share is its own too: the whole cap needs more addresses than two.
            more = [_connect(port, "127.0.0.2") for _ in range(CAP // 2)]
            time.sleep(0.2)
            third = _get(port, "127.0.0.3")
            assert third.startswith(b"HTTP/1.1 503 ") and b"x-sglpd-refused: connection-limit" in third, third[:200]
            for sock in more:
                sock.close()
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        # Closed connections give the share back.
        assert _get(port, "127.0.0.1").startswith(b"HTTP/1.1 200 ")


def test_a_trickled_body_is_cut_at_the_minimum_rate_and_a_steady_one_is_read() -> None:
    limits = {"body_timeout_s": 60.0, "body_grace_s": 0.5, "body_min_rate": 2000}
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    with capped_server(limits) as port:
        # A byte every 0.2 s (5 B/s): far below 2000 B/s once the 0.5 s grace is spent.
        with _connect(port, "127.0.0.1") as sock:
            sock.sendall(head % 100_000)
            started = time.monotonic()
            data = b""
            sock.settimeout(0.2)
            while not data and time.monotonic() - started < 10:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")
                with contextlib.suppress(TimeoutError):
                    data = sock.recv(65536)
            cut_after = time.monotonic() - started
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        assert b"minimum of 2000 bytes/s" in data
        assert cut_after < 2.0, cut_after  # not the 60 s whole-body deadline
        # 12,000 bytes over 3 s (4000 B/s): past the grace, and above the rate throughout.
        size, pieces = 12_000, 30
        with _connect(port, "127.0.0.1") as sock:
            sock.sendall(head % size)
            for _ in range(pieces):
                time.sleep(0.1)
                sock.sendall(b"b" * (size // pieces))
            answer = _answer(sock, 5.0)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert orjson.loads(answer.partition(b"\r\n\r\n")[2]) == {"read": size}
