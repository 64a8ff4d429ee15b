"""Child processes: spawn, wait until ready, stop. Used by `up`, the KV peer, tests and benchmarks.

A child gets its own process group (so stopping it stops its grandchildren too) and, on Linux,
SIGTERM when the process that started it dies however it dies (PR_SET_PDEATHSIG), so nothing is
left behind. Readiness is either the child's first stdout line (children that pick their own
ports print them) or an HTTP URL answering 200. What a caller prints or logs of a child's output
goes through `mask_secrets` first when the child was given a secret.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

__all__ = ["Child", "http_ok", "mask_secrets", "port_in_use", "spawn"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """A started child process (see `spawn`)."""

    def __init__(self, name: str, proc: subprocess.Popen[Any]) -> None:
        self.name = name
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def first_line(self, timeout_s: float) -> str:
        """The child's first stdout line (spawned with `stdout=PIPE`); RuntimeError if it exits or
        stays silent for `timeout_s`."""
        out: IO[Any] | None = self.proc.stdout
        assert out is not None, f"{self.name} was spawned without stdout=PIPE"
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if sel.select(timeout=0.1):
                    line = out.readline()
                    if line:
                        return line if isinstance(line, str) else line.decode()
                if not self.alive():
                    break
        raise RuntimeError(self._not_ready(timeout_s))

    def wait_http(self, url: str, timeout_s: float, *, interval_s: float = 0.1) -> None:
        """Poll `url` until it answers 200; RuntimeError if the child exits or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            if http_ok(url):
                return
            time.sleep(interval_s)
        raise RuntimeError(self._not_ready(timeout_s, url))

    def _not_ready(self, timeout_s: float, url: str = "") -> str:
        where = f" ({url})" if url else ""
        if not self.alive():
            return f"{self.name} exited with code {self.proc.returncode} before it was ready{where}."
        return f"{self.name} was not ready within {timeout_s:g} s{where}."

    def kill(self) -> None:
        """SIGKILL the child alone (as a crashed node dies) and reap it."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after `grace_s`, reap it."""
        if self.alive():
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        self.reap()

    def reap(self) -> None:
        """SIGKILL whatever is left of the group (grandchildren too) and reap the child."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def http_ok(url: str, timeout_s: float = 2.0, headers: Mapping[str, str] | None = None) -> bool:
    """One readiness probe: whether `url` answers 200 now (`headers`: e.g. the worker key)."""
    try:
        return httpx.get(url, timeout=timeout_s, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    text: bool = True,
    pass_fds: Sequence[int] = (),
    group: int | None = None,
) -> Child:
    """Start `argv` in its own process group, dying with this process; `env` is added to ours;
    `pass_fds`: open file descriptors the child inherits (a listening socket); `group`: the
    child's primary group id (root only; `sglang-pd up` gives its engines the KV group)."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, **(env or {})},
        text=text,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        pass_fds=tuple(pass_fds),
        group=group,
    )
    return Child(name, proc)


def mask_secrets(raw: bytes, secrets: Iterable[str], shown: str) -> bytes:
    """A child's output line with each of `secrets` replaced by `shown`, before it is printed or logged."""
    for secret in secrets:
        raw = raw.replace(secret.encode(), shown.encode())
    return raw


def port_in_use(host: str, port: int) -> str | None:
    """None when `host:port` can be bound now; else who holds it ("pid 123: python -m ...", or
    "another process" where /proc does not say)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT is free, a listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    return _listener(port) or "another process"


def _listener(port: int) -> str | None:
    """The process listening on TCP `port`, from /proc (Linux): its socket inode, then the fd."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{proc.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    cmd = Path(f"/proc/{proc.name}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    return f"pid {proc.name}: {cmd[:200]}"
    return None
