"""`up` and the worker key: sglang engines get `--api-key` as in a pod, nothing `up` shows holds the key."""

from __future__ import annotations

import argparse
import io
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.ops import up as local
from sglang_pd.deploy.ops.keyfile import CONFIG_FLAG, KeyFile
from sglang_pd.deploy.ops.launch import API_KEY_FLAG, API_KEY_SHOWN
from sglang_pd.deploy.spec.topology import PRESETS_DIR, load_checked_topology
from tests.support.polling import free_ports

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

PRESETS = PRESETS_DIR
KEY = "wk-7f3c9a0e1d2b4c5a"


def _installed_sglang() -> tuple[str, frozenset[str]]:
    from sglang_pd.deploy.sglang.compat import installed_options

    installed = installed_options()
    if installed is None:
        pytest.skip("sglang does not import here (its argument parser builds the engine commands)")
    return installed


def _engines(specs: list[local.ChildSpec]) -> list[local.ChildSpec]:
    return [s for s in specs if s.name != "router"]


def test_sglang_engines_get_the_key_only_when_it_is_set(tmp_path: Path) -> None:
    _installed_sglang()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    t, _ = load_checked_topology("single-h200")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)

    without = local.sglang_children(t, host="127.0.0.1", port=24500, env={})
    assert [s.name for s in _engines(without)] == ["prefill-0", "decode-0"]
    for spec in without:
        assert not any(a.startswith(API_KEY_FLAG) for a in spec.argv)
        assert not spec.health_headers and not spec.secrets

    key_file = KeyFile(KEY, parent=tmp_path)
    with_key = local.sglang_children(t, host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: KEY}, key_file=key_file)
    for plain, keyed in zip(_engines(without), _engines(with_key), strict=True):
        # Not on the command line, which every local user can read: in the key file.
        assert keyed.argv == [*plain.argv, CONFIG_FLAG, str(key_file.path)] and KEY not in " ".join(keyed.argv)
        # sglang's own reader takes it as its API key (argv: python -m sglang.launch_server ...).
        assert keyed.argv[1:3] == ["-m", "sglang.launch_server"]
        merged = ConfigArgumentMerger(parser).merge_config_with_args(keyed.argv[3:])
        assert parser.parse_args(merged).api_key == KEY
        assert keyed.health_headers == {"authorization": f"Bearer {KEY}"} and keyed.secrets == (KEY,)
    with pytest.raises(local.LaunchError, match="KeyFile"):
        local.sglang_children(t, host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: KEY})
    router = with_key[-1]
    assert router.name == "router" and API_KEY_FLAG not in router.argv and KEY not in " ".join(router.argv)


def test_a_key_in_extra_args_or_a_malformed_key_is_refused_as_in_a_pod() -> None:
    _installed_sglang()
    t, _ = load_checked_topology("single-h200")
    doubled = t.model_copy(update={"prefill": t.prefill.model_copy(update={"extra_args": ["--api-key", "x"]})})
    with pytest.raises(local.LaunchError, match=r"prefill\.extra_args sets --api-key"):
        local.sglang_children(doubled, host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: KEY})
    with pytest.raises(local.LaunchError, match="starts with '-'"):
        local.sglang_children(t, host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: "-" + KEY})
    with pytest.raises(local.LaunchError, match="whitespace or control characters"):
        local.sglang_children(t, host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: KEY + "\n"})
    with pytest.raises(local.LaunchError, match="set but empty"):
        local.local_children(
            load_checked_topology("local-cpu")[0], host="127.0.0.1", port=24500, env={ENV_WORKER_API_KEY: ""}
        )


def test_up_with_a_malformed_key_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _installed_sglang()
    monkeypatch.setenv(ENV_WORKER_API_KEY, "two words")
    parser = argparse.ArgumentParser()
    local.add_arguments(parser)
    assert local.run(parser.parse_args(["single-h200", "--engine", "sglang"])) == local.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ENV_WORKER_API_KEY} contains whitespace") and "two words" not in err


def test_child_output_shows_the_key_masked_on_the_console_and_in_the_log(tmp_path: Path) -> None:
    # sglang logs its ServerArgs at start, api_key included (sglang/srt/entrypoints/engine.py).
    script = f"print(\"server_args=ServerArgs(api_key='{KEY}', port=30000)\", flush=True)"
    to_file = local.ChildSpec("engine", [sys.executable, "-c", script], "http://127.0.0.1:1/", secrets=(KEY,))
    to_console = local.ChildSpec(
        "router", [sys.executable, "-c", script], "http://127.0.0.1:1/", secrets=(KEY,), log_to_file=False
    )
    out = io.StringIO()
    stack = local.Stack([to_file, to_console], out=out, log_dir=tmp_path)
    stack.start()
    deadline = time.monotonic() + 30
    while any(c.alive() for c in stack.procs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stack.stop()
    log = (tmp_path / "engine.log").read_text()
    assert f"api_key='{API_KEY_SHOWN}'" in log and KEY not in log
    assert f"router | server_args=ServerArgs(api_key='{API_KEY_SHOWN}'" in out.getvalue()
    assert KEY not in out.getvalue()


def test_reference_stack_with_the_key_serves_through_the_router_and_refuses_direct_calls(tmp_path: Path) -> None:
    """The real `up local-cpu` with SGLANG_PD_WORKER_API_KEY: the router (which inherits the key) gets
    answers; an engine called directly without the key answers 401; no output or log holds the key."""
    prefill, bootstrap, decode, router = free_ports(4)
    t = yaml.safe_load((PRESETS / "local-cpu.yaml").read_text())
    t["prefill"].update(port=prefill, bootstrap_port=bootstrap)
    t["decode"]["port"] = decode
    t["router"]["port"] = router
    t["model"]["config_json"] = str(PRESETS / t["model"]["config_json"])
    topo = tmp_path / "local.yaml"
    topo.write_text(yaml.safe_dump(t))
    logs = tmp_path / "logs"
    # --no-kv-firewall: this machine's netfilter rules stay untouched (tests/deploy/kv/test_firewall.py
    # runs the fenced `up` in a network namespace of its own).
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(logs), "--no-kv-firewall"]
    env = {ENV_WORKER_API_KEY: KEY, "SGLANG_PD_ROUTER_WORKER_API_KEY": ""}  # the router falls back to the same key
    proc = spawn("up", argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).proc
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    t0 = time.monotonic()
    try:
        # `up` waits for the engines' /health (sent with the key) and smoke-tests through the router.
        while not any(ln.startswith("smoke: ") for ln in seen):
            assert time.monotonic() - t0 < 120, "not ready within 120 s:\n" + "".join(seen[-40:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen[-40:])
        assert "chat completion ok" in next(ln for ln in seen if ln.startswith("smoke: "))
        body = {"model": t["model"]["served_name"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{router}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        for port in (prefill, decode):
            for path in ("/health", "/abort_request"):
                bare = httpx.request(
                    "GET" if path == "/health" else "POST", f"http://127.0.0.1:{port}{path}", timeout=10
                )
                assert bare.status_code == 401, (port, path, bare.text)
            keyed = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
            assert keyed.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    while not lines.empty():
        seen.append(lines.get())
    printed = "".join(seen)
    assert KEY not in printed
    for log in logs.iterdir():
        assert KEY not in log.read_text(errors="replace"), log


def test_up_without_a_key_generates_one_and_its_engines_refuse_unkeyed_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `up local-cpu` with no SGLANG_PD_WORKER_API_KEY: it says the engines are keyed, the
    router serves, and an engine called directly without the key answers 401."""
    monkeypatch.delenv(ENV_WORKER_API_KEY, raising=False)
    monkeypatch.delenv("SGLANG_PD_ROUTER_WORKER_API_KEY", raising=False)
    prefill, bootstrap, decode, router = free_ports(4)
    t = yaml.safe_load((PRESETS / "local-cpu.yaml").read_text())
    t["prefill"].update(port=prefill, bootstrap_port=bootstrap)
    t["decode"]["port"] = decode
    t["router"]["port"] = router
    t["model"]["config_json"] = str(PRESETS / t["model"]["config_json"])
    topo = tmp_path / "local.yaml"
    topo.write_text(yaml.safe_dump(t))
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topo), "--log-dir", str(tmp_path / "logs"),
            "--no-kv-firewall", "--no-smoke"]  # fmt: skip
    proc = spawn("up", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).proc
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    t0 = time.monotonic()
    try:
        while not any("ready in" in ln or "OpenAI base URL" in ln for ln in seen):
            assert time.monotonic() - t0 < 120, "not ready within 120 s:\n" + "".join(seen[-40:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen[-40:])
        assert any(ln.startswith("engines are keyed: a worker key was generated") for ln in seen), "".join(seen)
        body = {"model": t["model"]["served_name"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{router}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        for port in (prefill, decode):
            bare = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert bare.status_code == 401, (port, bare.text)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
