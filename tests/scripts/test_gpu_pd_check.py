"""The GPU check's wait for a PD stack, against a real router-shaped HTTP server and a real `up`-like
child: nothing is measured while `up` still runs its smoke request."""

from __future__ import annotations

import importlib
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
check = importlib.import_module("gpu_pd_check")


class _Router(BaseHTTPRequestHandler):
    """GET /workers with one healthy prefill and decode, GET /readiness 200: a router that serves."""

    def do_GET(self) -> None:
        doc = (
            {"status": "ready"}
            if self.path == "/readiness"
            else {"prefill": [{"healthy": True}], "decode": [{"healthy": True}]}
        )
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return None


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(check, "ROUTER", url)
    yield url
    server.shutdown()
    server.server_close()


def _up(lines_then_sleep: str) -> list[str]:
    """A child that prints like `up` does, then stays (or exits)."""
    return [sys.executable, "-u", "-c", lines_then_sleep]


def test_the_stack_is_ready_only_once_up_has_finished_its_smoke_request(router: str, tmp_path: Path) -> None:
    stack = check.Stack(tmp_path)
    # The router has healthy workers from the start; `up` prints its smoke line and curl example later.
    script = (
        "import time\n"
        "print('ready in 1.0 s (sglang engine, topology single-h200-sbo)')\n"
        "time.sleep(1.5)\n"
        "print('smoke: chat completion ok in 176 ms (32 tokens); streamed ok in 1200 ms (6 chunks)')\n"
        f"print({check.UP_STARTED!r} + '-s http://127.0.0.1:8000/v1/chat/completions')\n"
        "time.sleep(60)\n"
    )
    stack.start("up", _up(script))
    try:
        got = check.wait_stack(stack, timeout_s=30)
        assert got["readiness"] == 200
        assert got["ready_s"] >= 1.5  # not at the router's first healthy answer
        assert "smoke: chat completion ok" in (tmp_path / "up.log").read_text()
    finally:
        stack.stop_all()


def test_an_up_that_exits_during_start_up_is_not_ready(router: str, tmp_path: Path) -> None:
    stack = check.Stack(tmp_path)
    script = "import sys\nprint('error: the stack is healthy, but its smoke request failed')\nsys.exit(4)\n"
    stack.start("up", _up(script))
    try:
        with pytest.raises(check.NotReady, match="`sglang-pd up` exited with code 4"):
            check.wait_stack(stack, timeout_s=30)
    finally:
        stack.stop_all()
