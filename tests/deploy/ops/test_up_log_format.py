"""One log format across `up`'s components: the router's lines on the console, the reference
engines' log files (their own events and uvicorn's lines) and `up`'s own `up.log` are JSON objects
that open with an ISO-8601 UTC `ts`. The lines other libraries write straight to the stream keep
theirs (Mooncake's glog lines, the model loader's progress bar), as do `up`'s notes under them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.kv.mooncake_logs import NOTE_PREFIX

from .test_up import _topology
from .test_up_smoke import _Up
from .test_up_ttft_breakdown import KV_PORTS

pytestmark = pytest.mark.slow

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
# Written by Mooncake (glog: I1206 01:02:03.456789 pid file:line] ...) or by a progress bar, not by us.
FOREIGN = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} |WARNING: Logging before InitGoogleLogging|Loading weights)")


def ours(line: str) -> bool:
    """The line is in the one format: a JSON object whose first key is an ISO-8601 `ts`."""
    try:
        entry = json.loads(line)
    except ValueError:
        return False
    return isinstance(entry, dict) and next(iter(entry), None) == "ts" and bool(ISO.fullmatch(str(entry["ts"])))


def test_router_engines_and_up_log_one_format(tmp_path: Path) -> None:
    # The control: the formats this replaces fail the check.
    assert not ours('{"ts":1796520359.459275,"level":"info","logger":"sglang_pd.router","msg":"router started"}')
    assert not ours("INFO:     Started server process [25745]")
    assert not ours('{"event": "kv_sent", "rid": "r1", "role": "prefill"}')

    topo, port = _topology(tmp_path)
    logs = tmp_path / "logs"
    up = _Up(topo, logs, KV_PORTS)
    try:
        seen = up.read_until(lambda seen: any(ln.startswith("try: ") for ln in seen), timeout_s=180)
        assert up.proc.poll() is None, "".join(seen[-40:])
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        up.stop()
    console = up.read_until(lambda _: False, timeout_s=60)

    router = [ln.partition("| ")[2].rstrip("\n") for ln in console if ln.startswith("router ")]
    assert any('"msg":"request finished"' in ln for ln in router), router[-5:]
    assert all(ours(ln) for ln in router), [ln for ln in router if not ours(ln)][:3]

    for name in ("prefill-0", "decode-0"):
        lines = (logs / f"{name}.log").read_text().splitlines()
        mine = [ln for ln in lines if ln.strip() and not FOREIGN.match(ln) and not ln.startswith(NOTE_PREFIX)]
        assert all(ours(ln) for ln in mine), (name, [ln for ln in mine if not ours(ln)][:3])
        events = [json.loads(ln) for ln in mine]
        assert any(e.get("logger") == "uvicorn.error" for e in events), name  # uvicorn's lines too
        assert any(e.get("event") == ("kv_sent" if name == "prefill-0" else "kv_received") for e in events), name
        assert any(FOREIGN.match(ln) for ln in lines), name  # Mooncake's own lines are there, unchanged

    own = (logs / "up.log").read_text().splitlines()
    assert all(ours(ln) for ln in own), [ln for ln in own if not ours(ln)][:3]
    said = [json.loads(ln)["msg"] for ln in own]
    assert any(m.startswith("ready in ") for m in said) and any(m.startswith("try: ") for m in said), said
