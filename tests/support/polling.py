"""Small helpers tests share: free loopback ports, and waiting for a condition."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

__all__ = ["free_port", "free_ports", "wait_until"]


#: Ports handed out here lie below Linux's ephemeral range (32768-60999 by default), where no outgoing
#: connection takes one, and each pytest-xdist worker draws from its own slice: a port chosen by one
#: worker cannot be taken by another's child before the child that was given it binds it. Ports are
#: handed out _STRIDE apart, because a colocated topology's later instances take the ports after
#: the one it was given (deploy/spec/topology.py, `instance_endpoints`).
_FIRST_PORT, _SLICE, _STRIDE = 20000, 1500, 8
_next: list[int] = []


def _slice_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return _FIRST_PORT + (int(worker) % 8 if worker.isdigit() else 0) * _SLICE


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports, free right now, from this worker's slice (in turn, so not soon reused)."""
    start = _slice_start()
    if not _next:
        _next.append(start)
    out: list[int] = []
    for _ in range(_SLICE):
        port = _next[0]
        _next[0] = start + (port + _STRIDE - start) % _SLICE
        if _bindable(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free loopback ports in {start}-{start + _SLICE - 1}: stop what holds them")


def free_port() -> int:
    return free_ports(1)[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `predicate()` holds, polled every 10 ms; fails the test after `timeout`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - started
