"""`sglang-pd router --processes N` where it goes wrong: a state change lost when a serving
process connects, signals and port trouble during the control process's first health check, a
control process that is SIGKILLed, a socket that takes connections before its process serves,
and a temporary directory whose path is too long for a Unix socket. Real processes wherever the
behaviour involves them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.procs import Child, spawn
from sglang_pd.deploy.router.control import ControlLink, ControlServer
from sglang_pd.deploy.router.workers import WorkerRegistry
from tests.support.polling import free_port, wait_until
from tests.support.router_worker_server import WorkerProcess, start_workers

CHAT = "/v1/chat/completions"
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Group:
    """A router process group started as a user starts it, its log in a file."""

    def __init__(self, log: Path, port: int, *flags: str, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
                "--processes", "2", *flags]  # fmt: skip
        self.log, self.port, self.url = log, port, f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self.child: Child = spawn("router group", argv, stdout=out, stderr=subprocess.STDOUT, text=False, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            with contextlib.suppress(ValueError):
                if line.startswith("{"):
                    out.append(json.loads(line))
        return out

    def started(self) -> int:
        return sum(1 for x in self.lines() if x.get("msg") == "router started")

    def serving_pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in Path(f"/proc/{self.child.pid}/task/{self.child.pid}/children").read_text().split()]
        return []

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None when it still runs after `timeout_s`."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.child.proc.wait(timeout=timeout_s)
        return None

    def stop(self) -> None:
        pids = self.serving_pids()
        self.child.stop(grace_s=5)
        for pid in pids:  # serving processes live in their own sessions: not in the group's killpg
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    prefills, decodes = start_workers(1, 1, no_log=True)
    yield prefills[0], decodes[0]
    for w in prefills + decodes:
        w.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR for the group, short enough for a Unix socket path, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="pgr-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def silent_worker() -> Iterator[socket.socket]:
    """A 'worker' whose port accepts connections and never answers: each health probe of it
    takes the whole health timeout. Readable once a probe has connected."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock


def _silent_url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _wait_for_probe(sock: socket.socket, group: Group, timeout_s: float = 30.0) -> None:
    """Until the control process's first health check has connected to `sock` (it then waits the
    health timeout before it starts the serving processes)."""
    readable, _, _ = select.select([sock], [], [], timeout_s)
    assert readable, "the control process never probed the worker:\n" + group.text()[-3000:]
    assert group.serving_pids() == [], "serving processes started before the first check ended"


def _gone(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


# -- the control channel ------------------------------------------------------------------------


def _state(url: str, healthy: bool) -> dict[str, Any]:
    return {"url": url, "role": "decode", "bootstrap_port": None, "source": "static", "healthy": healthy,
            "dp_size": 1, "models": ["m"], "last_error": "", "checked": True}  # fmt: skip


async def _nothing(op: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 400, {}


def test_a_change_made_just_before_a_serving_process_connects_reaches_the_others(tmp_path: Path) -> None:
    """A health change waits for the next publish (every 50 ms); a serving process connecting
    in between (a restart) must not swallow it for the processes already connected."""

    async def main() -> None:
        states = [_state("http://127.0.0.1:7001", healthy=True)]
        server = ControlServer(str(tmp_path / "c.sock"), state=lambda: states, handle=_nothing,
                               on_report=lambda *_: None, on_hello=lambda *_: None)  # fmt: skip
        await server.start()
        first = WorkerRegistry()
        link = ControlLink(server.path, 0, first.sync, on_lost=lambda: None)
        await link.connect(timeout_s=5)
        assert first.decode[0].healthy

        states[0] = _state("http://127.0.0.1:7001", healthy=False)  # the control's health check ejects it
        late = ControlLink(server.path, 1, WorkerRegistry().sync, on_lost=lambda: None)
        await late.connect(timeout_s=5)  # ... and a restarted serving process connects before the publish
        server.publish()  # the periodic publish
        await asyncio.sleep(0.2)
        try:
            assert not first.decode[0].healthy, "process 0 still routes to the worker the control ejected"
        finally:
            await link.aclose()
            await late.aclose()
            await server.aclose()

    asyncio.run(main())


# -- signals and ports during start-up ----------------------------------------------------------


def test_sigterm_during_the_first_health_check_stops_the_group_at_once(
    tmp_path: Path, short_tmp: Path, silent_worker: socket.socket
) -> None:
    """Kubernetes may stop a pod while it starts: the group must not start serving processes
    after SIGTERM, and must exit 0 without waiting for a drain deadline."""
    url = _silent_url(silent_worker)
    group = Group(tmp_path / "router.log", free_port(), "--prefill", url, "--decode", url, "--health-timeout", "3",
                  "--drain-timeout", "2", env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        _wait_for_probe(silent_worker, group)
        group.child.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        status = group.wait(30)
        took = time.monotonic() - sent
        killed = [x for x in group.lines() if x.get("msg") == "serving process did not drain in time; killing it"]
        assert (status, killed) == (0, []), f"exit {status} after {took:.1f} s:\n{group.text()[-3000:]}"
        assert took < 6.0, f"took {took:.1f} s to stop"
    finally:
        group.stop()


def test_a_port_taken_during_the_first_health_check_stops_the_group_with_a_clear_error(
    tmp_path: Path, short_tmp: Path, silent_worker: socket.socket
) -> None:
    """The port is checked before the first health check and bound after it: another server
    that binds it in between leaves the group restarting serving processes that cannot bind,
    forever. It should stop with an error naming the port, as a port in use at start does."""
    url = _silent_url(silent_worker)
    port = free_port()
    group = Group(tmp_path / "router.log", port, "--prefill", url, "--decode", url, "--health-timeout", "3",
                  env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        _wait_for_probe(silent_worker, group)
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))
            other.listen()
            status = group.wait(15)
        assert status is not None, "the group still runs 15 s later:\n" + group.text()[-2000:]
        assert status != 0 and str(port) in group.text()
    finally:
        group.stop()


def test_a_same_user_reuseport_listener_does_not_silently_share_the_port(
    tmp_path: Path, short_tmp: Path, silent_worker: socket.socket
) -> None:
    """A stale or second router of the same user that listens with SO_REUSEPORT after the port
    check (a second group started at the same time, say) joins the group's port: the kernel
    then sends part of the group's connections to that other process."""
    url = _silent_url(silent_worker)
    port = free_port()
    group = Group(tmp_path / "router.log", port, "--prefill", url, "--decode", url, "--health-timeout", "3",
                  env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        _wait_for_probe(silent_worker, group)
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            other.bind(("127.0.0.1", port))
            other.listen(64)
            # Either the group refuses to start, or it must own every connection to its port.
            wait_until(lambda: group.started() == 2 or not group.child.alive(), 30)
            if group.child.alive():
                lost = 0
                for _ in range(20):
                    try:
                        httpx.get(group.url + "/health", headers={"connection": "close"}, timeout=1)
                    except httpx.TimeoutException:
                        lost += 1
                assert lost == 0, f"{lost} of 20 connections to the group's port went to another process"
    finally:
        group.stop()


# -- the control process dies -------------------------------------------------------------------


def test_a_sigkilled_control_process_leaves_no_keys_behind(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """The member file holds the API, admin and worker keys. An OOM kill of the control process
    (SIGKILL: no `finally`) must not leave it, nor the rest of the group's directory, behind
    (in a pod /tmp outlives container restarts; each kill would add one)."""
    prefill, decode = workers
    group = Group(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                  "--decode", decode.url, "--api-key", "client-secret", "--admin-key", "admin-secret",
                  env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        pids = group.serving_pids()
        assert [p.name[:17] for p in short_tmp.iterdir()] == ["sglang-pd-router-"]
        os.kill(group.child.pid, signal.SIGKILL)
        wait_until(lambda: all(_gone(pid) for pid in pids), 15)  # they drain and exit: no leak of processes
        left = [str(p.relative_to(short_tmp)) for p in short_tmp.rglob("*")]
        assert left == [], f"left behind: {left}"
    finally:
        group.stop()


# -- a serving process that restarts --------------------------------------------------------------


def test_a_restarting_serving_process_takes_no_connections_before_it_serves(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """The control process listens on the new socket before it starts the serving process:
    connections the kernel hashes to that socket wait for the process's whole start-up
    (interpreter, imports, control channel) while the other process idles."""
    prefill, decode = workers
    group = Group(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                  "--decode", decode.url, env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)

        def timed(_: int) -> float:
            started = time.monotonic()
            response = httpx.post(group.url + CHAT, json=BODY, headers={"connection": "close"}, timeout=30)
            assert response.status_code == 200
            return time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            usual = sorted(pool.map(timed, range(8)))  # both processes serving: this machine's pace
            first = group.serving_pids()
            os.kill(first[0], signal.SIGKILL)
            wait_until(lambda: any(pid not in first for pid in group.serving_pids()), 10)  # spawned, starting
            took = sorted(pool.map(timed, range(8)))
        shown = f"request times in s, usual {[round(t, 2) for t in usual]}, while one process restarts " + str(
            [round(t, 2) for t in took]
        )
        assert took[-1] < usual[-1] + 0.3, shown
    finally:
        group.stop()


# -- environment ----------------------------------------------------------------------------------


def test_a_long_tmpdir_is_a_clear_error_or_works(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """The control socket lives under TMPDIR; a Unix socket path has at most 107 bytes (unix(7)).
    A long TMPDIR (CI workspaces) must not end in a traceback."""
    long_tmp = short_tmp / ("t" * 80)
    long_tmp.mkdir()
    prefill, decode = workers
    group = Group(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                  "--decode", decode.url, env={"TMPDIR": str(long_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2 or not group.child.alive(), 30)
        text = group.text()
        assert "Traceback" not in text, text[-2500:]
        if not group.child.alive():
            assert group.child.proc.returncode == 2 and "TMPDIR" in text, text[-2500:]
    finally:
        group.stop()


def test_metrics_files_stay_bounded_across_serving_process_restarts(
    workers: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """Each serving process writes its own files to the group's metrics directory; the files of
    a dead process stay (its counters must keep counting) and every scrape reads all of them. A
    process that crash-loops (a restart every 10 s at most) must not add files without bound."""
    prefill, decode = workers
    group = Group(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                  "--decode", decode.url, env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        for restart in range(1, 4):
            os.kill(group.serving_pids()[0], signal.SIGKILL)
            wait_until(lambda: group.started() == 2 + restart, 30)  # noqa: B023 (used at once)
            for _ in range(4):
                assert httpx.post(group.url + CHAT, json=BODY, headers={"connection": "close"}).status_code == 200
        metrics_dir = next(short_tmp.glob("sglang-pd-router-*/metrics"))
        files = sorted(p.name for p in metrics_dir.iterdir())
        writers = {name.rsplit("_", 1)[1] for name in files}
        on_disk_kib = sum(p.stat().st_blocks for p in metrics_dir.iterdir()) // 2
        assert len(writers) <= 3, f"{len(files)} files ({on_disk_kib} KiB on disk) of {len(writers)} processes: {files}"
    finally:
        group.stop()
