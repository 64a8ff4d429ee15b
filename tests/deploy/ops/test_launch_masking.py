"""`sglang-pd launch` with a worker key: sglang runs as a supervised child (`launch.supervise`).

Real processes: a launcher process runs `supervise` on a stand-in for sglang (sglang itself cannot
run here) that logs the key as sglang logs its ServerArgs, then sleeps until a signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from sglang_pd.deploy.common.procs import Child, spawn
from sglang_pd.deploy.ops.launch import API_KEY_SHOWN

KEY = "wk-3b8e1f0c9d2a"

# The launcher: supervise the command in its argv, the key from the environment as the secret.
LAUNCHER = f"""
import os, sys
from sglang_pd.deploy.ops.launch import supervise
sys.exit(supervise(sys.argv[1:], dict(os.environ), (os.environ[{ENV_WORKER_API_KEY!r}],)))
"""

# Stands in for sglang: prints the key on stderr, then its pid and the key on stdout (sglang logs
# `server_args=ServerArgs(api_key=...)` at start), then sleeps. With an exit code in argv[2], it
# exits with it on SIGTERM or SIGINT, as a graceful stop; without one, the signal's default applies.
STAND_IN = """
import os, signal, sys, time
key = sys.argv[1].split("=", 1)[1]
if len(sys.argv) > 2:
    def stop(signum, _frame):
        print(f"stand-in got {signal.Signals(signum).name}", flush=True)
        sys.exit(int(sys.argv[2]))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
# stderr first: the test signals on seeing the stdout line, and a signal arriving between the two
# prints would end the stand-in before its stderr line was written.
print(f"stderr: api_key={key}", file=sys.stderr, flush=True)
print(f"{os.getpid()} server_args=ServerArgs(api_key='{key}', port=30000)", flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.fixture
def launch_stand_in():
    """Start the launcher on the stand-in; returns (launcher, the stand-in's pid, its first stdout line)."""
    started: list[tuple[Child, int]] = []

    def start(*stand_in_args: str) -> tuple[Child, int, str]:
        argv = [sys.executable, "-c", LAUNCHER, sys.executable, "-c", STAND_IN, f"--api-key={KEY}", *stand_in_args]
        launcher = spawn("launch", argv, env={ENV_WORKER_API_KEY: KEY}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = launcher.first_line(timeout_s=60)
        child_pid = int(first.split()[0])
        started.append((launcher, child_pid))
        return launcher, child_pid, first

    yield start
    for launcher, child_pid in started:
        launcher.reap()
        if _running(child_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


def test_the_key_never_reaches_the_output_and_lines_come_through_while_the_child_runs(launch_stand_in) -> None:
    launcher, child_pid, first = launch_stand_in("0")
    # The line arrived while the stand-in sleeps: copied as it was written, not at exit.
    assert _running(child_pid)
    assert first.rstrip("\n") == f"{child_pid} server_args=ServerArgs(api_key='{API_KEY_SHOWN}', port=30000)"
    os.kill(launcher.pid, signal.SIGTERM)
    out, err = launcher.proc.communicate(timeout=30)
    assert launcher.proc.returncode == 0
    assert out == "stand-in got SIGTERM\n"
    assert err == f"stderr: api_key={API_KEY_SHOWN}\n"  # stderr stays on stderr, masked too
    assert KEY not in first + out + err


@pytest.mark.parametrize(
    ("sig", "stand_in_args", "status"),
    [
        (signal.SIGTERM, ("7",), 7),  # a graceful stop: the child's own exit status
        (signal.SIGINT, ("9",), 9),
        (signal.SIGTERM, (), 128 + signal.SIGTERM),  # the signal ended the child: 128 + N, as a shell says
    ],
    ids=["sigterm-handled", "sigint-handled", "sigterm-default"],
)
def test_a_signal_to_the_launcher_reaches_the_child_and_its_status_is_the_launchers(
    launch_stand_in, sig, stand_in_args, status
) -> None:
    launcher, child_pid, _ = launch_stand_in(*stand_in_args)
    os.kill(launcher.pid, sig)
    out, _ = launcher.proc.communicate(timeout=30)
    assert launcher.proc.returncode == status
    if stand_in_args:
        assert out == f"stand-in got {sig.name}\n"
    assert not _running(child_pid)


def test_a_killed_launcher_leaves_no_child_behind(launch_stand_in) -> None:
    launcher, child_pid, _ = launch_stand_in()
    os.kill(launcher.pid, signal.SIGKILL)  # no handler runs: the kernel's parent-death signal must do it
    launcher.proc.wait(timeout=10)
    deadline = time.monotonic() + 2.0
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _running(child_pid), f"the stand-in (pid {child_pid}) outlived its killed launcher"
