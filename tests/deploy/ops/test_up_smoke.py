"""`up`'s smoke request, with real engines and router: it carries the router's client key, and a
failure says what failed and how to skip the request, without a traceback."""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from sglang_pd.deploy.common.contract import ENV_ROUTER_API_KEYS
from sglang_pd.deploy.common.procs import spawn

from .test_up import _topology

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CLIENT_KEY = "ck-5d1e8b2a9f0c4e7b"


class _Up:
    """A real `sglang-pd up` whose console lines (stdout and stderr) arrive in a queue."""

    def __init__(self, topo: Path, logs: Path, env: dict[str, str] | None = None) -> None:
        # --no-kv-firewall: this machine's netfilter rules stay untouched (tests/deploy/kv/test_firewall.py
        # runs the fenced `up` in a network namespace of its own).
        argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(logs)]
        argv.append("--no-kv-firewall")
        self.proc = spawn("up", argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def read_until(self, done: Callable[[list[str]], bool], timeout_s: float = 120) -> list[str]:
        """The lines so far once `done(lines)` holds or `up` has exited; fails after `timeout_s`."""
        t0 = time.monotonic()
        while not done(self.seen):
            assert time.monotonic() - t0 < timeout_s, f"not done within {timeout_s} s:\n" + "".join(self.seen[-40:])
            if self.proc.poll() is not None:
                self._reader.join(timeout=10)  # the pipe's last lines
                while not self.lines.empty():
                    self.seen.append(self.lines.get())
                break
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=1))
        return self.seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def test_smoke_request_sends_the_first_client_key(tmp_path: Path) -> None:
    topo, port = _topology(tmp_path)
    env = {ENV_ROUTER_API_KEYS: f" {CLIENT_KEY} , ck-second"}  # spaced as people write lists
    up = _Up(topo, tmp_path / "logs", env)
    try:
        seen = up.read_until(lambda seen: any(ln.startswith("try: ") for ln in seen))
        printed = "".join(seen)
        assert up.proc.poll() is None, printed
        assert "chat completion ok" in next(ln for ln in seen if ln.startswith("smoke: ")), printed
        curl = next(ln for ln in seen if ln.startswith("try: "))
        assert f"Authorization: Bearer <a key of {ENV_ROUTER_API_KEYS}>" in curl
        # The router does require the key: this is not a router that lets anyone in.
        model = yaml.safe_load(topo.read_text())["model"]["served_name"]
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        keyed = httpx.post(url, json=body, headers={"Authorization": "Bearer ck-second"}, timeout=30)
        assert keyed.status_code == 200, keyed.text
    finally:
        up.stop()
    assert CLIENT_KEY not in "".join(up.read_until(lambda _: False))


def test_a_failed_smoke_request_names_the_failure_and_how_to_skip_it(tmp_path: Path) -> None:
    topo, _ = _topology(tmp_path)
    t = yaml.safe_load(topo.read_text())
    t["router"]["request_timeout_s"] = 0.001  # no engine answers that fast: the real router answers 504
    topo.write_text(yaml.safe_dump(t))
    up = _Up(topo, tmp_path / "logs")
    try:
        seen = up.read_until(lambda _: False)
    finally:
        up.stop()
    printed = "".join(seen)
    assert up.proc.returncode == 4, printed
    error = next((ln for ln in seen if ln.startswith("error: ")), "")
    assert error.startswith("error: the stack is healthy, but its smoke request"), printed
    assert "failed: the router answered 504 Gateway Timeout: " in error and ".." not in error, printed
    assert error.endswith("; start with --no-smoke to skip the smoke request.\n"), printed
    assert "Traceback" not in printed
    assert "stopped: every child process has exited." in printed
