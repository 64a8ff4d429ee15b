"""The router's flags for its connection limits between clients (--source-share, --body-min-rate,
--body-grace), against a real `sglang-pd router` process on loopback: the share one address may
hold and the body rate follow the flags (the defaults, in a router started without them, do not
give the same counts), and a bad value is refused at start with the flag's name."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.common.procs import spawn
from tests.support.polling import free_port

CAP = 8


@contextlib.contextmanager
def _router(tmp_path: Path, *flags: str) -> Iterator[int]:
    port = free_port()
    argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
            "--max-connections", str(CAP), "--header-timeout", "30", *flags]  # fmt: skip
    log = tmp_path / f"router-{port}.log"
    with log.open("wb") as out:
        child = spawn("router", argv, stdout=out, stderr=subprocess.STDOUT, text=False)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2).status_code == 200:
                    break
            assert child.proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        yield port
    finally:
        child.proc.terminate()
        child.proc.wait(timeout=30)


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _kept_of(port: int, n: int) -> int:
    """How many of `n` idle connections from 127.0.0.1 the router keeps (the rest get 503)."""
    held = [_connect(port, "127.0.0.1") for _ in range(n)]
    try:
        time.sleep(0.5)
        refused = 0
        for sock in held:
            sock.settimeout(0.3)
            with contextlib.suppress(TimeoutError):
                data = sock.recv(65536)
                if data:
                    assert data.startswith(b"HTTP/1.1 503 ") and b"x-sglpd-refused: source-limit" in data, data[:300]
                    refused += 1
        # Another address is still served meanwhile.
        with _connect(port, "127.0.0.2") as other:
            other.sendall(b"GET /readiness HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            other.settimeout(5)
            assert other.recv(65536).startswith(b"HTTP/1.1 200 ")
        return n - refused
    finally:
        for sock in held:
            sock.close()


def _trickle_cut_after(port: int) -> tuple[bytes, float]:
    """A body declared 100 kB sent at 5 bytes/s: the answer and when it came."""
    with _connect(port, "127.0.0.1") as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        started, data = time.monotonic(), b""
        sock.settimeout(0.2)
        while not data and time.monotonic() - started < 8:
            with contextlib.suppress(OSError):
                sock.sendall(b"a")
            with contextlib.suppress(TimeoutError):
                data = sock.recv(65536)
        return data, time.monotonic() - started


def _loopback_alias_works() -> bool:
    with contextlib.suppress(OSError), socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return True
    return False


@pytest.mark.skipif(not _loopback_alias_works(), reason="127.0.0.2 cannot be bound here")
def test_the_flags_set_the_share_and_the_body_rate(tmp_path: Path) -> None:
    with _router(tmp_path, "--source-share", "0.25", "--body-min-rate", "2000", "--body-grace", "0.5") as port:
        assert _kept_of(port, CAP) == CAP // 4
        data, cut_after = _trickle_cut_after(port)
        assert data.startswith(b"HTTP/1.1 408 ") and b"minimum of 2000 bytes/s" in data, data[:300]
        assert cut_after < 3.0, cut_after
    # Control: the defaults (half the cap, 1 KiB/s after 10 s) give other counts, so the flags did it.
    with _router(tmp_path) as port:
        assert _kept_of(port, CAP) == CAP // 2
        data, cut_after = _trickle_cut_after(port)
        assert data == b"" and cut_after >= 7.9, (data[:300], cut_after)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--source-share", "1.5"], "Config 'source_share' has value 1.5. It must be > 0 and <= 1"),
        (["--source-share", "0"], "Config 'source_share' has value 0.0. It must be > 0 and <= 1"),
        (["--body-min-rate", "-1"], "Config 'body_min_rate' has value -1. It must be >= 0."),
        (["--body-grace", "0"], "Config 'body_grace_s' has value 0.0. It must be > 0."),
    ],
)
def test_a_bad_value_is_refused_at_start(flags: list[str], message: str) -> None:
    argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--port", str(free_port()), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr
