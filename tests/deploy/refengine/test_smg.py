"""The same two engines behind smg 1.13.0 in PD mode instead of our router."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.polling import free_port

from .conftest import PDStack

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")

pytestmark = [
    pytest.mark.skipif(not os.path.exists(SMG), reason="smg (the `dev` extra: smg==1.13.0) is not installed"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def smg_url(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    argv = [SMG, "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefill", pd_stack.prefill.url, str(pd_stack.prefill.bootstrap_port), "--decode", pd_stack.decode.url]
    # smg's metrics listener defaults to 0.0.0.0:29000, which another smg on this machine may hold.
    argv += ["--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"smg not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_chat_through_smg(smg_url: str) -> None:
    body = {
        "model": "tiny-deepseek-v3",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    r = httpx.post(f"{smg_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["choices"][0]["finish_reason"] in ("length", "stop")
    with httpx.stream("POST", f"{smg_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == full["choices"][0]["message"]["content"]


def test_generate_through_smg(smg_url: str) -> None:
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{smg_url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4
