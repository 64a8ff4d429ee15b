"""`sglang-pd up`: the whole local stack from a topology, ready within 90 s, nothing left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.spec.topology import PRESETS_DIR
from tests.support.polling import free_ports

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

PRESET = PRESETS_DIR / "local-cpu.yaml"


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, frontier = set(), [pid]
    while frontier:
        for c in children.get(frontier.pop(), []):
            out.add(c)
            frontier.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _topology(tmp: Path) -> tuple[Path, int]:
    prefill, bootstrap, decode, router = free_ports(4)
    t = yaml.safe_load(PRESET.read_text())
    t["prefill"].update(port=prefill, bootstrap_port=bootstrap)
    t["decode"]["port"] = decode
    t["router"]["port"] = router
    t["model"]["config_json"] = str(PRESET.parent / t["model"]["config_json"])
    path = tmp / "local.yaml"
    path.write_text(yaml.safe_dump(t))
    return path, router


def test_up_serves_chat_within_90s_and_stops_cleanly(tmp_path: Path) -> None:
    topo, port = _topology(tmp_path)
    t0 = time.monotonic()
    logs = tmp_path / "logs"
    # --no-kv-firewall: this machine's netfilter rules stay untouched (tests/deploy/kv/test_firewall.py
    # runs the fenced `up` in a network namespace of its own).
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(logs), "--no-kv-firewall"]
    up = spawn("up", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc = up.proc
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    try:
        while not any(ln.startswith("smoke: ") for ln in seen):
            assert time.monotonic() - t0 < 90, "not ready within 90 s:\n" + "".join(seen[-40:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen[-40:])
        assert any(ln.startswith("ready in ") for ln in seen)
        assert f"OpenAI API: http://127.0.0.1:{port}/v1\n" in seen
        # `up` itself proves the stack answers, plain and streamed, before it says so.
        smoke = next(ln for ln in seen if ln.startswith("smoke: "))
        assert "chat completion ok" in smoke and "streamed ok" in smoke
        # A line per component as it starts and as it turns healthy; engines log to files, the
        # router to the console.
        for name in ("prefill-0", "decode-0", "router"):
            assert any(ln.startswith("[") and f"] {name}: starting" in ln for ln in seen), name
            assert any(ln.startswith(f"{name}: healthy after ") for ln in seen), name
        assert f"engine logs: {logs}\n" in seen
        assert (logs / "prefill-0.log").stat().st_size > 0 and (logs / "decode-0.log").stat().st_size > 0
        assert not any(ln.startswith("prefill-0 | ") for ln in seen)
        model = yaml.safe_load(PRESET.read_text())["model"]["served_name"]
        body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as s:
            data = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and json.loads(data[0][6:])["object"] == "chat.completion.chunk"
        assert time.monotonic() - t0 < 90
        children = _descendants(proc.pid)
        assert len(children) >= 3  # prefill, decode, router

        # A dead engine is restarted; the router answers 503 meanwhile and serves again after.
        decode = next(p for p in children if b"--role\x00decode" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(decode, signal.SIGKILL)
        t1 = time.monotonic()
        while True:
            assert time.monotonic() - t1 < 90, "no answer after the decode engine was restarted"
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
                if r.status_code == 200:
                    break
                assert r.status_code in (502, 503), r.text
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        while not lines.empty():
            seen.append(lines.get())
        assert any(ln.startswith("decode-0: exited with code") for ln in seen), "".join(seen[-20:])
        assert any(ln.startswith("decode-0: restarting (restart 1)") for ln in seen), "".join(seen[-20:])
        children = _descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in children if _alive(c)], "orphaned child processes"


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from sglang_pd.deploy.ops.up import ChildSpec, Stack
        specs = [ChildSpec(f"sleep-{i}", ["sleep", "60"], "http://127.0.0.1:1/") for i in range(2)]
        stack = Stack(specs, out=sys.stderr)
        stack.start()
        print(" ".join(str(p.pid) for p in stack.procs.values()), flush=True)
        time.sleep(60)
        """
    )
    parent = spawn("a stand-in for up", [sys.executable, "-c", script], stdout=subprocess.PIPE).proc
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = [p for p in pids if _alive(p)]
    for p in leftover:
        os.kill(p, signal.SIGKILL)
    assert not leftover, "children outlived a SIGKILLed `up`"


def test_gpu_topology_without_cuda_is_a_clear_error() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `up` would start sglang")
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "up", "deepseek-r1-h200-1p1d"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "GPU topology" in r.stderr and "sglang-pd up local-cpu" in r.stderr
