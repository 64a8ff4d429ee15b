"""A client too slow for its stream is cut, and its decode work is aborted.

A raw socket with a small receive buffer asks for a long stream and reads nothing. Once a chunk has
waited `--slow-reader-timeout` to be taken, the router drops the connection and aborts the
request on both engines: the decode stops generating long before the answer's end. The control:
with the cut off (0), the same reader holds the decode's slot while it generates on.

The cut comes once the bytes nobody takes have filled the client's socket, the router's kernel
buffer and its transport buffer: about 1,300 tokens of this stream, some 5 s on a quiet 2-core
machine and several times that under a parallel test run. So the cut case waits on those bytes
(up to `CUT_WINDOW_S`), and checks that the decode stopped long before the answer's end. (The
engine's abort counter cannot tell: the router's dropped stream often stops the request before its
`/abort_request` arrives, and only the latter is counted.)
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from .conftest import Proc, launcher

pytestmark = pytest.mark.slow

CUT_S = 1.0
MAX_NEW = 4000  # near the engines' 4,096-token context: the answer ends long after the cut would come
CUT_WINDOW_S = 120.0  # the longest wait for the cut: the buffers fill at the decode's token rate
WINDOW_S = 15.0  # how long the control's reader is watched


def _silent_reader(url: str) -> socket.socket:
    """A connection that asks for a long stream and takes nothing: its receive buffer stays small."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(
        {
            "text": "Tell me a very long story.",
            "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0},
        }
    ).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _running(decode: Proc) -> float:
    return decode.metric("sglang_pd_refengine_running_requests")


def _watch(decode: Proc, window_s: float) -> tuple[float | None, float | None]:
    """Seconds until the decode runs the request, and until it stops running it (None: not within `window_s`)."""
    t0 = time.monotonic()
    started = stopped = None
    while time.monotonic() - t0 < window_s:
        running = _running(decode)
        if started is None and running > 0:
            started = time.monotonic() - t0
        if started is not None and running == 0:
            stopped = time.monotonic() - t0
            break
        time.sleep(0.1)
    return started, stopped


def _dropped(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the router has closed the connection: reading what it holds ends in EOF or a reset."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize("cut", [CUT_S, 0.0], ids=["cut", "control-no-cut"])
def test_a_reader_that_takes_nothing_is_cut_and_its_decode_work_aborted(tmp_path: Path, cut: float) -> None:
    with launcher(tmp_path) as lx:
        prefill, decode = lx.engine("prefill"), lx.engine("decode")
        router = lx.router(prefill, decode, args=["--slow-reader-timeout", str(cut)])
        lx.wait()
        sock = _silent_reader(router.url)
        try:
            started, stopped = _watch(decode, CUT_WINDOW_S if cut else WINDOW_S)
            assert started is not None, "the decode never ran the request"
            if cut:
                assert stopped is not None, f"the decode still generates after {CUT_WINDOW_S} s: the reader was not cut"
                made = decode.metric("sglang_pd_refengine_generation_tokens_total")
                assert made < MAX_NEW, f"the decode stopped after the whole answer ({made:g} tokens), not a cut"
                assert _dropped(sock), "the router kept the slow reader's connection open"
                # The router says why (a warning: the router runs at --log-level warning here).
                assert "slow reader: one chunk waited 1 s to be taken" in router.log.read_text()
            else:
                # The control: nothing cuts the reader, and the decode generates on for it.
                assert stopped is None, f"the decode stopped after {stopped} s with the cut off"
                assert _running(decode) == 1
        finally:
            sock.close()
