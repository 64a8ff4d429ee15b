"""A router process group (`sglang-pd router --processes N`) started as a user starts it, as a
real process with its log in a file, and what tests read of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from sglang_pd.deploy.common.procs import Child, spawn

__all__ = ["RouterGroup", "gone"]


class RouterGroup:
    def __init__(self, log: Path, port: int, *flags: str, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
                "--processes", "2", *flags]  # fmt: skip
        self.log, self.port, self.url = log, port, f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self.child: Child = spawn("router group", argv, stdout=out, stderr=subprocess.STDOUT, text=False, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        """The log's JSON lines (a line being written is skipped)."""
        out = []
        for line in self.text().splitlines():
            with contextlib.suppress(ValueError):
                if line.startswith("{"):
                    out.append(json.loads(line))
        return out

    def started(self) -> int:
        """How many serving processes have started serving so far (restarts included)."""
        return sum(1 for x in self.lines() if x.get("msg") == "router started")

    def serving_pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in Path(f"/proc/{self.child.pid}/task/{self.child.pid}/children").read_text().split()]
        return []

    def fresh(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A request on a new connection: the kernel picks the serving process for each one."""
        return httpx.request(method, self.url + path, headers={"connection": "close", **kwargs.pop("headers", {})},
                             timeout=10, **kwargs)  # fmt: skip

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None when it still runs after `timeout_s`."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.child.proc.wait(timeout=timeout_s)
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        pids = self.serving_pids()
        self.child.stop(grace_s=grace_s)
        for pid in pids:  # serving processes live in their own sessions: not in the group's killpg
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by init counts as exited)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
