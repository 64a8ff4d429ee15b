"""OpenTelemetry traces through the router (tracing.py), received by an OTLP/HTTP collector that
runs in this process on loopback: a request's server span (a child of the client's own
traceparent), a span per leg under it, and each leg's context sent to its engine as the W3C
`traceparent` header that sglang 0.5.23's `--enable-trace` reads. Off by default: a router
without the endpoint sends no traceparent and exports nothing (the control). The router and the
workers are real processes; the router imports and serves without OpenTelemetry's SDK and exporter."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.common.procs import spawn
from tests.support.polling import free_port, wait_until
from tests.support.router_worker_server import WorkerProcess, start_workers

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces receiver: every span it was sent, as a dict."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[dict[str, Any]] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for s in scope.spans:
                            spans.append({
                                "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "kind": s.kind,
                                "attrs": {a.key: a.value.string_value or a.value.int_value for a in s.attributes},
                            })  # fmt: skip
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def router(tmp_path: Path, prefill: WorkerProcess, decode: WorkerProcess, *extra: str) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
            "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
            "--health-interval", "0.5", *extra]  # fmt: skip
    with (tmp_path / f"router-{port}.log").open("wb") as out:
        child = spawn("router", argv, stdout=out, stderr=subprocess.STDOUT, text=False)
    try:
        child.wait_http(url + "/health", timeout_s=30)
        wait_until(lambda: httpx.get(url + "/readiness").json().get("decode") == 1, timeout=15)
        yield url
    finally:
        child.stop(grace_s=10)  # SIGTERM: the router sends what it still holds before it exits


def traceparents(worker: WorkerProcess) -> list[str | None]:
    return [r["headers"].get("traceparent") for r in worker.state()["requests"]]


def test_spans_cross_both_legs_and_reach_the_engines(tmp_path: Path) -> None:
    collector = Collector()
    (prefill,), (decode,) = start_workers(1, 1, token_delay=0.01)
    try:
        # The control first: off by default, nothing is sent to the engines or exported.
        with router(tmp_path, prefill, decode) as url:
            client_tp = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            assert httpx.post(url + CHAT, json=BODY, headers=client_tp, timeout=30).status_code == 200
        assert traceparents(prefill) == [None] and traceparents(decode) == [None]
        assert collector.spans == []

        with router(tmp_path, prefill, decode, "--otlp-traces-endpoint", collector.url) as url:
            answer = httpx.post(url + CHAT, json=BODY, headers=client_tp, timeout=30)
            assert answer.status_code == 200
            rid = answer.headers["x-router-request-id"]
            with httpx.stream("POST", url + CHAT, json={**BODY, "stream": True}, timeout=30) as streamed:
                assert streamed.status_code == 200
                streamed.read()
            wait_until(lambda: len(collector.spans) >= 6, timeout=15)  # batched every second
        seen = {"prefill": traceparents(prefill), "decode": traceparents(decode)}
    finally:
        for w in (prefill, decode):
            w.stop()

    servers = [s for s in collector.spans if s["name"] == f"POST {CHAT}"]
    assert len(servers) == 2, collector.spans
    unary = next(s for s in servers if s["attrs"]["sglang_pd.request_id"] == rid)
    # The client's trace goes on through the router: its span is the server span's parent.
    assert (unary["trace"], unary["parent"]) == (CLIENT_TRACE, CLIENT_SPAN)
    assert unary["attrs"]["http.response.status_code"] == 200
    for server in servers:
        legs = {s["name"]: s for s in collector.spans if s["parent"] == server["id"]}
        assert set(legs) == {"prefill", "decode"}, collector.spans
        assert all(leg["trace"] == server["trace"] for leg in legs.values())
        # Each engine got its own leg's span as the parent of what it does (W3C traceparent).
        for role in ("prefill", "decode"):
            sent = [tp.split("-")[1:3] for tp in seen[role] if tp]  # version-trace-parent-flags
            assert [server["trace"], legs[role]["id"]] in sent, (role, seen)
    assert not any(s["trace"] == CLIENT_TRACE for s in servers if s is not unary)  # the stream has its own trace


def test_a_bad_endpoint_is_refused_naming_the_form() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--otlp-traces-endpoint", "127.0.0.1:4317"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "it takes a collector's OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces" in done.stderr


NO_OTEL = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):  # the API comes with FastAPI
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from sglang_pd.deploy.router.app import create_app
from sglang_pd.deploy.router.config import RouterConfig
create_app(RouterConfig())
try:
    create_app(RouterConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces"))
except ValueError as exc:
    print(exc)
"""


def test_the_router_runs_without_opentelemetry() -> None:
    done = subprocess.run([sys.executable, "-c", NO_OTEL], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'sglang-pd[tracing]'" in done.stdout
