"""Small helpers tests share: free loopback ports, and waiting for a condition."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

__all__ = ["free_port", "free_ports", "wait_until"]


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now (all held open together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `predicate()` holds, polled every 10 ms; fails the test after `timeout`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - started
