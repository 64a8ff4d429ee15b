"""Serve a RouterApp with uvicorn (uvloop, httptools) and drain gracefully on SIGTERM: stop
accepting, answer 503 to new requests on open connections, let in-flight streams finish up to the
drain deadline, then close."""

from __future__ import annotations

import gc
import signal
import socket
from typing import Any

import uvicorn

from ..common.http_limits import raise_descriptor_limit, usable_connections
from .api.connection import router_protocol
from .app import RouterApp
from .log import configure_logging, logger

__all__ = ["RouterServer", "serve"]

# Container allocations between two young-generation collections (CPython's default is 700). A
# request allocates hundreds of short-lived objects, so at the default a collection ran about
# once a request.
_GC_YOUNG_THRESHOLD = 20_000


class RouterServer(uvicorn.Server):
    def __init__(self, app: RouterApp, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.router = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            # What it listens on, as bound (uvicorn's own "running on" line goes nowhere: log_config None).
            bound = [s.getsockname() for server in self.servers for s in (server.sockets or ())]
            urls = sorted({f"http://{_host_in_url(a[0])}:{a[1]}" for a in bound})
            logger.info("listening", extra={"urls": urls, "openai_base_url": _openai_base(urls)})

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGTERM:
            self.force_exit = True  # a second SIGTERM: stop waiting for the drain (as a second Ctrl-C)
        if not self.router.draining:
            logger.info("draining", extra={"signal": sig, "deadline_s": self.router.config.drain_timeout_s})
        self.router.start_draining()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals on exit; a finished drain is a clean exit (0).
            self._captured_signals.remove(sig)


def _host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _openai_base(urls: list[str]) -> str | None:
    """The OpenAI base URL a client on this machine uses: a wildcard address is reached on loopback."""
    if not urls:
        return None
    url = urls[0].replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    return f"{url}/v1"


def uvicorn_config(app: RouterApp, **overrides: Any) -> uvicorn.Config:
    cfg = app.config
    options: dict[str, Any] = {
        "host": cfg.host,
        "port": cfg.port,
        "loop": "uvloop",
        # httptools, with limits on each connection enforced while its bytes arrive
        # (deploy/common/http_limits.py) and a future per connection for requests to watch the client
        # with (connection.py).
        "http": router_protocol(cfg.connection_limits),
        "lifespan": "on",
        "access_log": False,
        # The router logs request ids, not client addresses: skip X-Forwarded-* rewriting.
        "proxy_headers": False,
        "log_config": None,
        "log_level": cfg.log_level,
        "timeout_graceful_shutdown": cfg.drain_timeout_s,
        "timeout_keep_alive": cfg.keep_alive_timeout_s,
        "backlog": 4096,
        "server_header": False,  # no "server: uvicorn" advertised to clients
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


def serve(app: RouterApp, *, sockets: list[socket.socket] | None = None) -> int:
    """Serve until stopped; the exit status. `sockets`: already-listening sockets to serve on
    (a router process group's) instead of binding the configured host and port."""
    configure_logging(
        app.config.log_level,
        {"router_process": app.owner.process_index} if app.owner.process_index is not None else None,
    )
    descriptors = raise_descriptor_limit()  # before the protocol class sizes its connection cap to it
    logger.info(
        "connection limits",
        extra={
            "open_files": descriptors,
            "max_connections": usable_connections(app.config.connection_limits, descriptors),
        },
    )
    server = RouterServer(app, uvicorn_config(app))
    _settle_garbage_collector()
    server.run(sockets=sockets)
    return 0 if server.started else 1


def _settle_garbage_collector() -> None:
    """Keep the cyclic garbage collector off the request path: what start-up built (FastAPI's
    routes, pydantic's schemas, the metrics) lives as long as the process, so `gc.freeze()` takes
    it out of every later collection, and young collections run less often. Collections were 4 %
    of the router's CPU in a native py-spy profile of benchmarks/bench_router.py (unary,
    concurrency 16); with both, under 0.3 %. Cycles are still collected, a little later."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, middle, old)
