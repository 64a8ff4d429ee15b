"""`up local-cpu` under more concurrent streams than its engines run: every request ends with 200,
429 or 503 (never 502), and the engines keep no bootstrap rooms, pages or requests afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from benchmarks.bench_overload import engine_leftovers, run_load

from .test_up import _topology
from .test_up_smoke import _Up

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # a whole stack under 64 streams: needs both cores

CLIENTS = 64  # twice the preset's max_running_requests on each engine
SECONDS = 20.0


def test_64_streams_get_200_429_or_503_and_leave_no_rooms(tmp_path: Path) -> None:
    topo, port = _topology(tmp_path)
    t = yaml.safe_load(topo.read_text())
    up = _Up(topo, tmp_path / "logs")
    try:
        seen = up.read_until(lambda seen: any(ln.startswith("smoke: ") for ln in seen))
        assert up.proc.poll() is None, "".join(seen)
        result = asyncio.run(run_load(f"http://127.0.0.1:{port}", clients=CLIENTS, seconds=SECONDS, max_tokens=8))
        engines = {
            "prefill": f"http://127.0.0.1:{t['prefill']['port']}",
            "decode": f"http://127.0.0.1:{t['decode']['port']}",
        }
        leftovers = engine_leftovers(engines)
    finally:
        up.stop()
    summary = result.summary()
    assert result.bad == 0, summary
    assert result.outcomes["200"] >= CLIENTS // 2, summary  # the stack served, not only refused
    assert result.retry_after_missing == 0, summary
    assert leftovers == {}, (leftovers, summary)
