"""A small HTTP server, as a process, serving through `LimitedProtocol` (deploy/common/http_limits.py)
with the limits given as JSON: tests of the connection cap, the per-source share and the body rate
against a real socket server, the same protocol the router and the reference engine run.

Routes: `GET /health` answers 200, or a plain 503 (no `x-sglpd-refused`) with `--health 503`, as
sglang does while its scheduler gives no output (`POST /health/503` and `POST /health/200` switch
it); `GET /v1/models` one model; `POST /echo` the length of the body it read.

    python -m tests.support.capped_server --port P --limits '{"max_connections": 4}' [--health 503]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sglang_pd.deploy.common.http_limits import ConnectionLimits, limited_protocol
from tests.support.polling import free_port, wait_until

__all__ = ["capped_server"]


def _app(health: int) -> Starlette:
    state = {"health": health}

    async def probe(_: Request) -> JSONResponse:
        status = state["health"]
        return JSONResponse({"status": "ok" if status == 200 else "unhealthy"}, status_code=status)

    async def switch(request: Request) -> JSONResponse:
        state["health"] = int(request.path_params["status"])
        return JSONResponse(state)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "test-model", "object": "model"}]})

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"read": len(await request.body())})

    routes = [
        Route("/health", probe),
        Route("/health/{status:int}", switch, methods=["POST"]),
        Route("/v1/models", models),
        Route("/echo", echo, methods=["POST"]),
    ]
    return Starlette(routes=routes)


@contextlib.contextmanager
def capped_server(limits: dict[str, Any], *, health: int = 200, host: str = "0.0.0.0") -> Iterator[int]:
    """Start the server with `limits` (ConnectionLimits fields), yield its port once it answers, stop it.
    It listens on `host` (every address by default, so 127.0.0.2 reaches it as well)."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.capped_server", "--port", str(port), "--host", host]
    argv += ["--limits", json.dumps(limits), "--health", str(health)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
            return False

        wait_until(up, timeout=20)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--limits", default="{}", help="ConnectionLimits fields as JSON")
    parser.add_argument("--health", type=int, default=200, choices=(200, 503))
    args = parser.parse_args()
    protocol = limited_protocol(ConnectionLimits(**json.loads(args.limits)))
    config = uvicorn.Config(
        _app(args.health), args.host, args.port, log_level="warning", access_log=False, http=protocol, lifespan="off"
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
