"""A KV peer: a process that registers one buffer and lets others write into it.

`python -m sglang_pd.deploy.kv.peer --size BYTES [--http-port P] [--memory gpu]` opens this process's
transfer engine, registers a zeroed buffer (host memory, or GPU memory: memory.py) and serves, over a
tiny HTTP API on loopback (or `--listen`):
`GET /info` (session id, buffer base and length), `GET /crc?offset=&length=` (crc32 of a slice),
`GET /fill?offset=&length=&byte=` and `GET /quit`. The first stdout line is the /info JSON plus
`http_port`. `kv-probe`, `benchmarks/bench_kv.py` and the tests use it as the decode side.

The control API is the standard library's threaded HTTP server: the peer's handlers touch the
registered buffer from plain threads, and it starts in milliseconds with nothing to install.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import httpx

from sglang_pd.deploy.common.procs import Child, spawn

from .config import KVConfig
from .engine import get_engine
from .memory import MEMORY_KINDS, allocate

__all__ = ["PeerInfo", "PeerProcess", "main", "start_peer"]


@dataclass(frozen=True)
class PeerInfo:
    session_id: str
    base: int
    length: int
    http: str  # http://host:port of the peer's control API


def _serve(size: int, listen: str, http_port: int, config: KVConfig, memory: str = "host") -> None:
    engine = get_engine(config)
    buf = allocate(memory, size)
    engine.register(buf.base, size)
    info = {"session_id": engine.session_id, "base": buf.base, "length": size, "memory": buf.describe()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            body: dict[str, object]
            if url.path == "/info":
                body = info
            elif url.path == "/crc":
                off, n = int(q["offset"]), int(q["length"])
                body = {"crc": zlib.crc32(buf.read(off, n))}
            elif url.path == "/fill":
                off, n = int(q["offset"]), int(q["length"])
                buf.write(off, bytes([int(q.get("byte", "0"))]) * n)
                body = {"ok": True}
            elif url.path == "/quit":
                body = {"ok": True}
                threading.Thread(target=server.shutdown, daemon=True).start()
            else:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((listen, http_port), Handler)
    print(json.dumps({**info, "http_port": server.server_address[1]}), flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_pd.deploy.kv.peer", description=__doc__)
    p.add_argument("--size", type=int, default=64 << 20, help="bytes to register (default 64 MiB)")
    p.add_argument("--listen", default="127.0.0.1", help="address of the control API")
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--hostname", default=None, help="address Mooncake peers reach this engine at")
    p.add_argument("--protocol", default=None, choices=("tcp", "rdma"))
    p.add_argument("--device", default=None)
    p.add_argument("--memory", choices=MEMORY_KINDS, default="host", help="register host or GPU memory (host)")
    a = p.parse_args(argv)
    config = KVConfig.from_env(hostname=a.hostname, protocol=a.protocol, device=a.device)
    _serve(a.size, a.listen, a.http_port, config, a.memory)
    return 0


class PeerProcess:
    """A running peer child process (see `start_peer`)."""

    def __init__(self, child: Child, info: PeerInfo) -> None:
        self.child = child
        self.proc = child.proc
        self.info = info

    def get(self, path: str) -> dict[str, object]:
        result: dict[str, object] = httpx.get(self.info.http + path, timeout=30).json()
        return result

    def crc(self, offset: int, length: int) -> int:
        return int(self.get(f"/crc?offset={offset}&length={length}")["crc"])  # type: ignore[call-overload]

    def kill(self) -> None:
        self.child.kill()


@contextmanager
def start_peer(
    size: int,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    group: int | None = None,
    memory: str = "host",
) -> Iterator[PeerProcess]:
    """Start a peer process on loopback (`group`: its primary group id; `memory`: host or gpu), yield it, and
    always stop it."""
    argv = [sys.executable, "-m", "sglang_pd.deploy.kv.peer", "--size", str(size), "--memory", memory]
    child = spawn("the KV peer process", argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, group=group)
    try:
        d = json.loads(child.first_line(timeout_s))
        info = PeerInfo(d["session_id"], d["base"], d["length"], f"http://127.0.0.1:{d['http_port']}")
        yield PeerProcess(child, info)
    finally:
        child.reap()


if __name__ == "__main__":
    sys.exit(main())
