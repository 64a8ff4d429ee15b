"""A keyless reference engine, whose routes read a body before any check, and connections that send a
request head and then no body: each is cut with 408 by the connection limits, and the engine logs
one line for it, not a traceback (the application saw a client that left while it read the body)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import pytest

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from tests.support.standalone_engine import standalone_engine

pytestmark = pytest.mark.slow  # the engine's body grace is 10 s

CONNECTIONS = 3


def _held_head(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n" % path)
    return sock


def test_a_body_that_never_arrives_is_cut_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_WORKER_API_KEY, raising=False)
    log = tmp_path / "engine.log"
    with standalone_engine(log) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [_held_head(port, p) for p in (b"/generate", b"/v1/chat/completions", b"/v1/completions")]
        answers = []
        for sock in held:
            sock.settimeout(30)
            data = b""
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    data += chunk
            answers.append(data)
            sock.close()
        time.sleep(1.0)  # what the engine logs after the cut
    assert len(answers) == CONNECTIONS
    for data in answers:
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    text = log.read_text(errors="replace")
    # The check can fail: the cuts are in this log, so a traceback would be too.
    assert text.count("request refused") >= CONNECTIONS, text[-3000:]
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-6000:]
