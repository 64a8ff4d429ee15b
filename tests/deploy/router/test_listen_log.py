"""The router logs where it listens once it does: a `listening` line with the bound URLs and the OpenAI base
URL a local client uses. Real `sglang-pd router` processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from sglang_pd.deploy.common.procs import spawn
from tests.support.polling import free_port

ROUTER = [sys.executable, "-m", "sglang_pd.deploy.cli", "router"]


def _lines_until(proc: subprocess.Popen[str], done, timeout_s: float = 60.0) -> list[str]:  # type: ignore[no-untyped-def]
    assert proc.stderr is not None
    seen: list[str] = []
    t0 = time.monotonic()
    for line in proc.stderr:
        seen.append(line)
        if done(line) or time.monotonic() - t0 > timeout_s:
            break
    return seen


def _log(line: str) -> dict | None:  # type: ignore[type-arg]
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def test_the_router_logs_its_listen_address_and_answers_there() -> None:
    port = free_port()
    router = spawn("router", [*ROUTER, "--host", "127.0.0.1", "--port", str(port)], stderr=subprocess.PIPE)
    try:
        seen = _lines_until(router.proc, lambda ln: (_log(ln) or {}).get("msg") == "listening")
        entry = _log(seen[-1]) or {}
        assert entry.get("msg") == "listening", "".join(seen)
        assert entry["urls"] == [f"http://127.0.0.1:{port}"]
        assert entry["openai_base_url"] == f"http://127.0.0.1:{port}/v1"
        # It does listen there, from the moment it says so.
        assert httpx.get(f"{entry['openai_base_url']}/models", timeout=10).status_code == 200

        # Control: a second router on the same port cannot bind it and says no `listening`.
        second = spawn("router", [*ROUTER, "--host", "127.0.0.1", "--port", str(port)], stderr=subprocess.PIPE)
        try:
            assert second.proc.wait(timeout=60) != 0
            assert second.proc.stderr is not None
            said = second.proc.stderr.read()
            assert '"msg":"listening"' not in said.replace(" ", ""), said
        finally:
            second.reap()
    finally:
        router.reap()


def test_a_wildcard_address_gives_the_loopback_base_url() -> None:
    port = free_port()
    router = spawn("router", [*ROUTER, "--host", "0.0.0.0", "--port", str(port)], stderr=subprocess.PIPE)
    try:
        seen = _lines_until(router.proc, lambda ln: (_log(ln) or {}).get("msg") == "listening")
        entry = _log(seen[-1]) or {}
        assert entry.get("urls") == [f"http://0.0.0.0:{port}"], "".join(seen)
        assert entry["openai_base_url"] == f"http://127.0.0.1:{port}/v1"
    finally:
        router.reap()
