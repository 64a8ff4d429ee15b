"""`up`'s engine logs with a real Mooncake engine: every line kept, expected lines explained, open ports warned."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import httpx

from sglang_pd.deploy.kv.listeners import listening_sockets
from sglang_pd.deploy.kv.mooncake_logs import NOTE_PREFIX
from sglang_pd.deploy.ops.up import ChildSpec, Stack
from tests.support.polling import free_port


def test_engine_log_keeps_every_line_explains_mooncake_and_warns_on_the_console(tmp_path: Path) -> None:
    """A KV peer process (a real Mooncake TCP engine, host name 127.0.0.1) run as an `up` child."""
    http_port = free_port()
    argv = [sys.executable, "-m", "sglang_pd.deploy.kv.peer", "--size", "4096", "--http-port", str(http_port)]
    spec = ChildSpec("kv-peer", argv, f"http://127.0.0.1:{http_port}/info", ports=(http_port,))
    out = io.StringIO()
    stack = Stack([spec], out=out, log_dir=tmp_path)
    try:
        stack.start()
        stack.wait_ready(60)
        info = httpx.get(spec.health_url, timeout=10).json()
        listeners = listening_sockets(stack.procs["kv-peer"].proc.pid)
    finally:
        stack.stop()

    log = (tmp_path / "kv-peer.log").read_text().splitlines()
    rpc_port = int(info["session_id"].rsplit(":", 1)[1])
    notes = [i for i, line in enumerate(log) if line.startswith(NOTE_PREFIX)]
    # Mooncake's TCP start always logs this one; the note sits right under it.
    descriptor = next(i for i, line in enumerate(log) if line.endswith("] Local segment descriptor not found"))
    assert descriptor + 1 in notes, log
    assert all(i > 0 and not log[i - 1].startswith(NOTE_PREFIX) for i in notes), log
    # Nothing lost: the peer's own first stdout line and Mooncake's info lines are there too.
    assert json.loads(next(line for line in log if line.startswith("{")))["session_id"] == info["session_id"]
    assert any(f"listening on 127.0.0.1:{rpc_port}" in line for line in log), log

    console = out.getvalue()
    warned = [line for line in console.splitlines() if line.startswith("kv-peer: warning: Mooncake listens on all")]
    assert len(warned) == 1, console
    assert f"0.0.0.0:{rpc_port} (handshake)" in warned[0]
    assert listeners is not None
    data_ports = [x for x in listeners if x.wildcard and x.port not in (rpc_port, http_port)]
    assert len(data_ports) == 1 and f"{data_ports[0]} (data)" in warned[0], (listeners, warned)
