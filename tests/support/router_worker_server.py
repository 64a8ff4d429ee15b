"""A `FakeWorker` (router_workers.py) served over real HTTP, as a process of its own.

    python tests/support/router_worker_server.py --role decode --port 0

prints one JSON line `{"port", "bootstrap_port", "pid"}` once it listens; a prefill also serves
its KV hand-off on the bootstrap port (`GET /kv/{room}`). `start_workers()` does all of that from
a test or a benchmark and returns handles whose `state()` and `configure()` reach the process
through `/_test/state` and `/_test/config`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sglang_pd.deploy.common.procs import Child, spawn

__all__ = ["WorkerProcess", "start_worker", "start_workers"]

_SCRIPT = Path(__file__).resolve()


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import ClientSession, ClientTimeout, web

    from tests.support.router_workers import FakeWorker

    session = ClientSession(timeout=ClientTimeout(total=args.handshake_timeout))

    async def fetch_kv(host: str, port: int, room: int) -> str | None:
        try:
            async with session.get(f"http://{host}:{port}/kv/{room}") as resp:
                await resp.read()
                return (
                    None
                    if resp.status == 200
                    else f"KV transfer for room {room} failed: bootstrap answered {resp.status}"
                )
        except Exception as exc:
            return f"KV transfer for room {room} from {host}:{port} failed: {type(exc).__name__} {exc}"

    options = ("model", "dp_size", "tokens", "token_delay", "prefill_delay", "handshake_timeout", "health_tick_s",
               "health_timeout_s", "starting_s", "sglang_version")  # fmt: skip
    worker = FakeWorker(
        args.role, fetch_kv=fetch_kv, keep_log=not args.no_log, **{k: getattr(args, k) for k in options}
    )

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/_test/state":
            return web.json_response(worker.state())
        if request.path == "/_test/config":
            worker.configure(**await request.json())
            return web.json_response({"success": True})
        raw = await request.read()
        try:
            reply = await worker.handle(request.method, request.path, dict(request.headers), raw)
            if isinstance(reply.body, bytes):
                return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)
            resp = web.StreamResponse(status=reply.status, headers={"content-type": reply.content_type})
            await resp.prepare(request)
            async for chunk in reply.body:
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # the router hung up (abort, disconnect): nothing to answer
            return web.Response(status=499)

    async def kv(request: web.Request) -> web.Response:
        status, info = await worker.kv_handoff(int(request.match_info["room"]))
        return web.json_response(info, status=status)

    runners = []
    if args.role == "prefill":
        boot = web.Application()
        boot.router.add_get("/kv/{room}", kv)
        boot_runner = web.AppRunner(boot, access_log=None, shutdown_timeout=0.5)
        await boot_runner.setup()
        await web.TCPSite(boot_runner, args.host, args.bootstrap_port, backlog=4096).start()
        worker.bootstrap_port = boot_runner.addresses[0][1]
        runners.append(boot_runner)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=4096).start()
    runners.append(runner)
    bootstrap = worker.bootstrap_port if args.role == "prefill" else None
    print(json.dumps({"port": runner.addresses[0][1], "bootstrap_port": bootstrap, "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for r in reversed(runners):
        await r.cleanup()
    await session.close()


def main(argv: list[str] | None = None) -> int:
    if __package__ in (None, ""):  # run as a script: the repository root holds `tests`
        sys.path.insert(0, str(_SCRIPT.parents[2]))
    from tests.support.router_workers import SGLANG_VERSIONS

    parser = argparse.ArgumentParser(description="A protocol-faithful PD test worker (no model).")
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bootstrap-port", type=int, default=0)
    parser.add_argument("--model", default="test-model")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="tokens to emit when the request sets no limit")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prefill-delay", type=float, default=0.0)
    parser.add_argument("--handshake-timeout", type=float, default=10.0)
    parser.add_argument("--health-tick-s", type=float, default=1.0, help="sglang's /health checks once a second")
    parser.add_argument("--health-timeout-s", type=float, default=20.0, help="sglang's SGLANG_HEALTH_CHECK_TIMEOUT")
    parser.add_argument("--starting-s", type=float, default=0.0, help="/health answers 503 this long after start")
    parser.add_argument("--sglang-version", choices=SGLANG_VERSIONS, default="0.5.23", help="/server_info's layout")
    parser.add_argument("--no-log", action="store_true", help="keep no per-request log (benchmarks)")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(_serve(args))
    return 0


# -- launching from tests and benchmarks ------------------------------------------------------------


@dataclass
class WorkerProcess:
    role: str
    child: Child
    port: int
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/_test/state").json())

    def configure(self, **changes: Any) -> None:
        httpx.post(self.url + "/_test/config", json=changes).raise_for_status()

    def kill(self) -> None:
        """SIGKILL: the worker dies mid-request, as a crashed node would."""
        self.child.kill()

    def stop(self) -> None:
        self.child.stop(grace_s=5)


def _flags(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:  # 0 is a value (`0 in (False,)` holds)
            out += [flag, str(value)]
    return out


def _spawn(role: str, options: dict[str, Any]) -> Child:
    argv = [sys.executable, str(_SCRIPT), "--role", role, *_flags(options)]
    return spawn(f"{role} test worker", argv, stdout=subprocess.PIPE)


def _ready(role: str, child: Child, timeout: float) -> WorkerProcess:
    info = json.loads(child.first_line(timeout))
    return WorkerProcess(role, child, info["port"], info["bootstrap_port"])


def start_worker(role: str, timeout: float = 20.0, **options: Any) -> WorkerProcess:
    child = _spawn(role, options)
    try:
        return _ready(role, child, timeout)
    except BaseException:
        child.stop(grace_s=1)
        raise


def start_workers(
    n_prefill: int, n_decode: int, timeout: float = 20.0, **options: Any
) -> tuple[list[WorkerProcess], list[WorkerProcess]]:
    """Start workers in parallel; returns (prefills, decodes). Stops them all if one fails."""
    children = [("prefill", _spawn("prefill", options)) for _ in range(n_prefill)]
    children += [("decode", _spawn("decode", options)) for _ in range(n_decode)]
    started: list[WorkerProcess] = []
    try:
        for role, child in children:
            started.append(_ready(role, child, timeout))
    except BaseException:
        for _, child in children:
            child.stop(grace_s=1)
        raise
    return [w for w in started if w.role == "prefill"], [w for w in started if w.role == "decode"]


if __name__ == "__main__":
    sys.exit(main())
