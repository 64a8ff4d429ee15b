"""`up`'s options and guards without starting engines: busy ports are refused with the holder
named, `--ports` moves components, the topology's router settings reach the router, sglang is
refused at once where it cannot run, and on stop the router drains before the engines get SIGTERM."""

from __future__ import annotations

import importlib.util
import io
import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_pd.deploy.ops.up import ChildSpec, Stack, check_fits_this_machine, local_children, parse_ports
from sglang_pd.deploy.spec.topology import TopologyError, load_checked_topology

from .test_up import _topology

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out


def test_busy_port_is_refused_naming_the_holder(tmp_path: Path) -> None:
    topo, _ = _topology(tmp_path)
    t, _ = load_checked_topology(str(topo))
    decode_port = t.decode.port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", decode_port))
        holder.listen()
        started = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(tmp_path / "logs")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1, r.stderr
    assert f"port {decode_port} (decode-0) is in use by pid {os.getpid()}" in r.stderr
    assert "--ports" in r.stderr and "starting" not in r.stdout, "nothing was started"
    assert time.monotonic() - started < 30


def test_ports_override_moves_engines_and_the_router_follows(tmp_path: Path) -> None:
    topo, _ = _topology(tmp_path)
    t, _ = load_checked_topology(str(topo))
    ports = parse_ports("prefill-0=28401, prefill-0.bootstrap=28402,decode-0=28403")
    specs = {s.name: s for s in local_children(t, host="127.0.0.1", port=28400, ports=ports)}
    assert specs["prefill-0"].ports == (28401, 28402)
    assert specs["prefill-0"].argv[specs["prefill-0"].argv.index("--port") :][:2] == ["--port", "28401"]
    assert "28402" in specs["prefill-0"].argv and specs["decode-0"].ports == (28403,)
    router = specs["router"].argv
    assert "http://127.0.0.1:28401" in router and "28402" in router and "http://127.0.0.1:28403" in router
    # The topology's router settings reach the router.
    flags = dict(itertools.pairwise(router))
    assert flags["--max-concurrent-requests"] == str(t.router.max_concurrent_requests)
    assert flags["--max-queued-requests"] == str(t.router.max_queued_requests)
    assert float(flags["--queue-timeout"]) == t.router.queue_timeout_s
    assert float(flags["--request-timeout"]) == t.router.request_timeout_s
    assert float(flags["--drain-timeout"]) > 0 and specs["router"].stop_grace_s > float(flags["--drain-timeout"])


@pytest.mark.parametrize("text", ["prefill-9=1000", "decode-0", "decode-0=http", "decode-0=70000"])
def test_bad_ports_are_clear_errors(tmp_path: Path, text: str) -> None:
    topo, _ = _topology(tmp_path)
    t, _ = load_checked_topology(str(topo))
    with pytest.raises(TopologyError, match=r"prefill-0|NAME=PORT"):
        local_children(t, host="127.0.0.1", port=28400, ports=parse_ports(text))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ports", "prefill-0=28111,decode-0=28111"], "port 28111 is given to both prefill-0 and decode-0"),
        (["--port", "28112", "--ports", "decode-0=28112"], "port 28112 is given to both router (--port) and decode-0"),
        (
            ["--ports", "prefill-0=28113,prefill-0.bootstrap=28113"],
            "port 28113 is given to both prefill-0 and prefill-0.bootstrap",
        ),
    ],
)
def test_one_port_given_to_two_components_is_refused_before_anything_starts(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    topo, _ = _topology(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(tmp_path / "logs"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"error: {named}. Give each its own port with --port / --ports."), r.stderr
    assert "engine logs" not in r.stdout and not (tmp_path / "logs").exists(), "nothing was started"


def test_sglang_runs_only_topologies_whose_instances_share_this_node() -> None:
    check_fits_this_machine(load_checked_topology("single-h200")[0])
    r1, _ = load_checked_topology("deepseek-r1-h200-1p1d")
    with pytest.raises(TopologyError, match=r"hardware\.colocated is false.*sglang-pd launch"):
        check_fits_this_machine(r1)


def _cuda_visible() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda_visible(), reason="this machine has CUDA: `up --engine sglang` would start sglang")
def test_sglang_engine_without_cuda_is_refused_at_once() -> None:
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "up", "single-h200", "--engine", "sglang"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - started < 30
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: --engine sglang needs sglang and a CUDA GPU, but on this machine "), r.stderr
    assert any(
        reason in r.stderr
        for reason in ("no CUDA device is visible (torch.cuda.is_available() is false)", "sglang is not installed")
    ), r.stderr
    assert "sglang-pd up local-cpu" in r.stderr and "--engine reference" in r.stderr
    assert "starting" not in r.stdout, "nothing was started"


def test_sglang_engine_without_sglang_is_refused_without_importing_torch() -> None:
    probe = (
        "import sys; sys.modules['sglang'] = None; "  # as if it were not installed
        "from sglang_pd.deploy.cli import main; rc = main(['up', 'single-h200', '--engine', 'sglang']); "
        "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
    assert "needs sglang and a CUDA GPU, but on this machine sglang is not installed." in r.stderr


def test_stop_drains_the_router_before_the_engines(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    router = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(1.0)\n"  # draining in-flight requests
        f"    open({str(marks)!r}, 'a').write(f'router-exit {{time.time()}}\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(60)\n"
    )
    engine = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(marks)!r}, 'a').write(f'engine-term {{time.time()}}\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(60)\n"
    )
    specs = [
        ChildSpec("engine", [sys.executable, "-c", engine], "http://127.0.0.1:1/"),
        ChildSpec(
            "router",
            [sys.executable, "-c", router],
            "http://127.0.0.1:1/",
            log_to_file=False,
            stop_grace_s=5,
            drains=True,
        ),
    ]
    stack = Stack(specs, out=sys.stderr, log_dir=tmp_path)
    stack.start()
    time.sleep(1.0)  # let both install their handlers
    stack.stop()
    events = dict(line.split() for line in marks.read_text().splitlines())
    assert float(events["engine-term"]) >= float(events["router-exit"]), events
    assert all(not c.alive() for c in stack.procs.values())


def test_a_dead_child_is_restarted_with_a_doubling_back_off(tmp_path: Path) -> None:
    out = io.StringIO()
    spec = ChildSpec("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"], "http://127.0.0.1:1/")
    stack = Stack([spec], out=out, log_dir=tmp_path, restart_backoff_s=0.1)
    stack.start()
    deadline = time.monotonic() + 3
    while stack.restarts["flaky"] < 3 and time.monotonic() < deadline:
        stack.supervise()
        time.sleep(0.02)
    stack.stop()
    text = out.getvalue()
    assert stack.restarts["flaky"] >= 3, text
    for delay in ("0.1", "0.2", "0.4"):
        assert f"flaky: exited with code 3; restarting in {delay} s" in text, text
    assert "flaky: restarting (restart 3)" in text


def test_the_back_off_starts_again_after_a_healthy_run(tmp_path: Path) -> None:
    # Each life lasts 0.4 s, past the 0.3 s the stack counts as healthy: every restart waits the
    # first back-off again (a doubling that never reset reached 16 s at the fifth restart).
    out = io.StringIO()
    spec = ChildSpec(
        "rare", [sys.executable, "-c", "import sys, time; time.sleep(0.4); sys.exit(3)"], "http://127.0.0.1:1/"
    )
    stack = Stack([spec], out=out, log_dir=tmp_path, restart_backoff_s=0.1, healthy_reset_s=0.3)
    stack.start()
    deadline = time.monotonic() + 15
    while stack.restarts["rare"] < 3 and time.monotonic() < deadline:
        stack.supervise()
        time.sleep(0.02)
    stack.stop()
    text = out.getvalue()
    assert stack.restarts["rare"] >= 3, text
    assert text.count("rare: exited with code 3; restarting in 0.1 s") >= 3, text
    assert "restarting in 0.2 s" not in text, text
