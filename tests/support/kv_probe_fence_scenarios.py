"""`sglang-pd kv-probe` beside a running, fenced `sglang-pd up`; run in a network namespace of its own
(tests.support.netns), so that the rules `up` installs never touch this machine's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.kv.firewall import fenced_engines
from sglang_pd.deploy.kv.listeners import listening_sockets, mooncake_port_range
from tests.support.kv_firewall_scenarios import _chains, _connect_here, _descendants
from tests.support.netns import REPO

KV_PROBE = [sys.executable, "-m", "sglang_pd.deploy.cli", "kv-probe", "--format", "json"]
SMALL = ["--pages", "8", "--layers", "2", "--repeat", "2"]
NOBODY = 65534


def _kv_probe(*prefix: str) -> dict[str, Any]:
    done = subprocess.run([*prefix, *KV_PROBE, *SMALL], capture_output=True, text=True, timeout=180, cwd=REPO)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {"unparsed": done.stdout[-2000:]}
    return {"exit_status": done.returncode, "report": report, "stderr": done.stderr[-3000:]}


def probe_beside_up(log_dir: str) -> dict[str, Any]:
    """A real fenced `up local-cpu`; then kv-probe on loopback as root (joins the engines' group and passes),
    as an unprivileged user (refused, naming up's fence), and a root socket outside the group connecting to the
    decode engine's KV port (refused: the fence is in force)."""
    low, high = mooncake_port_range()
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", "local-cpu", "--log-dir", log_dir, "--no-smoke"]
    up = spawn("up", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout = up.proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any(ln.startswith(("OpenAI API: ", "error: ")) for ln in lines):
        assert time.monotonic() < deadline and up.alive(), "".join(lines[-40:])
        time.sleep(0.2)
    try:
        engines = {p: c for p, c in _descendants(up.pid).items() if " engine --role " in c and "sglang_pd" in c}
        decode = next(p for p, c in engines.items() if "--role decode" in c)
        port = next(
            x.port for x in (listening_sockets(decode) or set()) if x.address == "0.0.0.0" and low <= x.port <= high
        )
        seen = fenced_engines()
        as_root = _kv_probe()
        # An unprivileged user who may still read this checkout and its interpreter (under /root here).
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) is needed"
        caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        as_user = _kv_probe(setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *caps, "--")
        outsider = _connect_here("127.0.0.1", port, gid=0)
        running = _chains()
    finally:
        up.proc.send_signal(signal.SIGTERM)
        code = up.proc.wait(timeout=90)
        reader.join(timeout=10)
    return {
        "up_pid": up.pid,
        "engine_pids": sorted(engines),
        "fenced_engines": {str(k): v for k, v in seen.items()},
        "as_root": as_root,
        "as_user": as_user,
        "outsider": outsider,
        "running": running,
        "up_exit_status": code,
        "fenced_after_stop": {str(k): v for k, v in fenced_engines().items()},
        "my_gid": os.getgid(),
        "output": [ln.rstrip() for ln in lines],
    }
