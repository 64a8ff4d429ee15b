"""`sglang-pd router --processes N` at its edges: signals and the port during the control
process's first health check, a control process that is SIGKILLed, a socket that could take
connections before its process serves, a long TMPDIR, and a serving process that keeps dying.
Real processes throughout."""

from __future__ import annotations

import concurrent.futures
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.polling import free_port, wait_until
from tests.support.router_group import RouterGroup, gone
from tests.support.router_worker_server import WorkerProcess

# slow: over 8 s in all on 2 cores (`make quick` leaves it out); serial: its latency bounds hold on
# idle cores, so `make unit` runs it alone, after the parallel part.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

CHAT = "/v1/chat/completions"
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR of its own for the group (to see what it leaves there), removed afterwards."""
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


def _wait_for_probe(sock: socket.socket, group: RouterGroup, timeout_s: float = 30.0) -> None:
    """Until the control process's first health check has connected to `sock` (it then waits the
    health timeout before it starts the serving processes)."""
    readable, _, _ = select.select([sock], [], [], timeout_s)
    assert readable, "the control process never probed the worker:\n" + group.text()[-3000:]
    assert group.serving_pids() == [], "serving processes started before the first check ended"


# -- signals and ports during start-up ----------------------------------------------------------


def test_sigterm_during_the_first_health_check_stops_the_group_at_once(
    tmp_path: Path, short_tmp: Path, silent_worker: socket.socket
) -> None:
    """Kubernetes may stop a pod while it starts: the group must not start serving processes
    after SIGTERM, and must exit 0 without waiting for a drain deadline."""
    url = _silent_url(silent_worker)
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", url, "--decode", url,
                        "--health-timeout", "3", "--drain-timeout", "2", env={"TMPDIR": str(short_tmp)})  # fmt: skip
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


def test_the_port_is_the_groups_before_its_first_health_check(
    tmp_path: Path, short_tmp: Path, silent_worker: socket.socket
) -> None:
    """Every socket is bound before the first health check (which can take the health timeout):
    another server cannot take the port in that window and leave the group unable to bind."""
    url = _silent_url(silent_worker)
    port = free_port()
    group = RouterGroup(tmp_path / "router.log", port, "--prefill", url, "--decode", url, "--health-timeout", "3",
                        env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        _wait_for_probe(silent_worker, group)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        wait_until(lambda: group.started() == 2, 30)
        assert httpx.get(group.url + "/health", timeout=5).status_code == 200
    finally:
        group.stop()


# -- the control process dies -------------------------------------------------------------------


def test_a_sigkilled_control_process_leaves_no_keys_behind(
    worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """An OOM kill of the control process (SIGKILL: no `finally`) must leave no key and no
    socket behind (in a pod /tmp outlives container restarts): only the metrics files stay."""
    prefill, decode = worker_processes
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                        "--decode", decode.url, "--api-key", "client-secret", "--admin-key", "admin-secret",
                  env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        pids = group.serving_pids()
        assert [p.name[:25] for p in short_tmp.iterdir()] == ["sglang-pd-router-metrics-"]
        os.kill(group.child.pid, signal.SIGKILL)
        wait_until(lambda: all(gone(pid) for pid in pids), 15)  # they drain and exit: no leak of processes
        left = [p for p in short_tmp.rglob("*") if p.is_file()]
        assert left and all(p.suffix == ".db" and not p.is_socket() for p in left), left
        for secret in (b"client-secret", b"admin-secret"):
            assert not any(secret in p.read_bytes() for p in left)
    finally:
        group.stop()


# -- a serving process that restarts --------------------------------------------------------------


def test_a_restarting_serving_process_takes_no_connections_before_it_serves(
    worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """The control process listens on the new socket before it starts the serving process:
    connections the kernel hashes to that socket wait for the process's whole start-up
    (interpreter, imports, control channel) while the other process idles."""
    prefill, decode = worker_processes
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
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
    worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """The control socket lives under TMPDIR; a Unix socket path has at most 107 bytes (unix(7)).
    A long TMPDIR (CI workspaces) must not end in a traceback."""
    long_tmp = short_tmp / ("t" * 80)
    long_tmp.mkdir()
    prefill, decode = worker_processes
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                        "--decode", decode.url, env={"TMPDIR": str(long_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2 or not group.child.alive(), 30)
        text = group.text()
        assert "Traceback" not in text, text[-2500:]
        if not group.child.alive():
            assert group.child.proc.returncode == 2 and "TMPDIR" in text, text[-2500:]
    finally:
        group.stop()


def test_a_serving_process_that_keeps_dying_stops_the_group(
    worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """Restarts are for accidents: a serving process that dies five times in a row, each time
    soon after its start, stops the group (and with it the growth of its metrics files), with an
    error naming what happened, instead of restarting forever."""
    prefill, decode = worker_processes
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                        "--decode", decode.url, env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        for death in range(5):
            wait_until(lambda: len(group.serving_pids()) == 2 and group.started() == 2 + death, 30)  # noqa: B023
            os.kill(max(group.serving_pids()), signal.SIGKILL)  # the newest: the same slot each time
        assert group.wait(30) == 1
        assert any("failed 5 times in a row" in x.get("msg", "") for x in group.lines()), group.text()[-2000:]
        assert not list(short_tmp.iterdir())  # a clean stop removes the metrics files
    finally:
        group.stop()


def test_a_frozen_serving_process_is_killed_and_replaced(
    worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path, short_tmp: Path
) -> None:
    """A serving process whose event loop stops (SIGSTOP here; a blocking bug alike) keeps its
    socket: the connections the kernel hashes to it would hang. Its heartbeat stops, so the
    control process kills it within seconds, and a restarted one serves."""
    prefill, decode = worker_processes
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefill.url, str(prefill.bootstrap_port),
                        "--decode", decode.url, env={"TMPDIR": str(short_tmp)})  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        frozen = group.serving_pids()[0]
        os.kill(frozen, signal.SIGSTOP)
        took = wait_until(lambda: gone(frozen), 15)
        assert took < 8.0  # five missed heartbeats, then the next supervision round
        stuck = [x for x in group.lines() if x.get("msg") == "serving process is stuck; killing it"]
        assert stuck and "heartbeat" in stuck[0]["reason"], group.text()[-2000:]
        wait_until(lambda: group.started() == 3, 30)
        statuses = [httpx.post(group.url + CHAT, json=BODY, headers={"connection": "close"}, timeout=5).status_code
                    for _ in range(20)]  # fmt: skip
        assert statuses == [200] * 20
    finally:
        group.stop()
