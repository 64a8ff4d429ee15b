"""The TTFT breakdown on the local stack: `sglang-pd up` with the reference engines and Mooncake
over TCP, under a steady load of other streams, first with the prefill's forward pass slowed,
then with its KV transfer slowed (the engines' test hooks). Each time the `Server-Timing` parts
add up to the time to first token the client measured, within 5 %, and the largest part is the
slowed one: `prefill` ends where the engine reports its forward pass done
(`meta_info.prefill_finished_time`, as sglang 0.5.23 with --enable-metrics), `transfer` runs
from there to the prefill's answer. Each run is the other's control: the check that finds
`prefill` behind the first finds `transfer` behind the second, and a sum that leaves `transfer`
out misses the client's TTFT by far more than 5 %."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.router.metrics import TTFT_PARTS

from .test_up import _topology
from .test_up_smoke import _Up

# Two stacks started and loaded, the breakdown against the client's clock: about a minute on 2 idle cores.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

# Mooncake's ports away from its default range, where another stack's KV fence on this host
# (`up` without --no-kv-firewall) refuses every other process's connections.
KV_PORTS = {"MC_MIN_RPC_PORT": "17100", "MC_MAX_RPC_PORT": "17600"}
DELAY_S = 1.0
TIMED = 3  # timed requests per stack
LOAD = 4  # streams kept in flight beside them

# The load: LOAD streamed /generate requests at all times, until the stop file appears; prints
# how many completed and the most that were in flight at once.
LOAD_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys, httpx
    url, n, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    done = 0
    async def one(client, i):
        global done
        body = {"text": f"Background prompt {i}: tell me about the sea.", "stream": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        async with client.stream("POST", url + "/generate", json=body) as r:
            async for _ in r.aiter_raw():
                pass
        done += r.status_code == 200
    async def worker(client, k):
        i = k
        while not os.path.exists(stop):
            await one(client, i)
            i += n
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(worker(client, k) for k in range(n)))
    asyncio.run(main())
    print(done, flush=True)
    """
)


def timed_stream(client: httpx.Client, url: str, i: int) -> tuple[float, dict[str, float]]:
    """One streamed /generate asking for the breakdown: the TTFT the client measured (request sent
    to the first body bytes) and the Server-Timing parts, in seconds."""
    body = {"text": f"Timed prompt {i}: where did the time go?", "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
    client.get(url + "/health")  # the connection is open before the clock starts
    started = time.perf_counter()
    with client.stream("POST", url + "/generate", json=body, headers={"x-sglpd-timing": "1"}) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()
        next(chunks)
        ttft = time.perf_counter() - started
        for _ in chunks:
            pass
    parts = {}
    for entry in r.headers["server-timing"].split(","):
        name, _, dur = entry.strip().partition(";dur=")
        parts[name] = float(dur) / 1000
    return ttft, parts


def blamed(parts: dict[str, float]) -> str:
    """The part the breakdown points at: the largest."""
    return max(TTFT_PARTS, key=lambda p: parts[p])


def shown(parts: dict[str, float], leave_out: str = "") -> float:
    return sum(parts[p] for p in TTFT_PARTS if p != leave_out)


def run_stack(tmp_path: Path, hook: str) -> tuple[list[tuple[float, dict[str, float]]], int, list[str]]:
    """Start `up` with the engine test hook `hook` set to DELAY_S, load it, time TIMED streams;
    returns the timings, the load's completed requests and up's console lines."""
    tmp_path.mkdir()
    topo, port = _topology(tmp_path)
    url = f"http://127.0.0.1:{port}"
    up = _Up(topo, tmp_path / "logs", {hook: str(DELAY_S), **KV_PORTS})
    stop = tmp_path / "stop"
    load = None
    try:
        seen = up.read_until(lambda seen: any(ln.startswith("try: ") for ln in seen), timeout_s=180)
        assert up.proc.poll() is None, "".join(seen[-40:])
        argv = [sys.executable, "-c", LOAD_SCRIPT, url, str(LOAD), str(stop)]
        load = spawn("load", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(3 * DELAY_S)  # the load is in flight
        timings = []
        with httpx.Client(timeout=60) as client:
            for i in range(TIMED):
                timings.append(timed_stream(client, url, i))
        stop.touch()
        out, _ = load.proc.communicate(timeout=180)  # the requests in flight finish (slow under CI load)
        completed = int(out.split()[-1])
        time.sleep(0.5)  # the last request lines reach the console
        return timings, completed, list(up.seen) + [up.lines.get() for _ in range(up.lines.qsize())]
    finally:
        stop.touch()
        if load is not None and load.proc.poll() is None:
            load.proc.kill()
        up.stop()


def check_adds_up(timings: list[tuple[float, dict[str, float]]]) -> None:
    for ttft, parts in timings:
        assert abs(shown(parts) - ttft) / ttft < 0.05, (ttft, parts)
        assert abs(parts["total"] - shown(parts)) < 1e-5, parts


def median(timings: list[tuple[float, dict[str, float]]], part: str) -> float:
    return statistics.median(parts[part] for _, parts in timings)


def logged_parts(lines: list[str]) -> list[dict[str, float]]:
    """The `timing_ms` of the router's request lines on up's console."""
    found = []
    for line in lines:
        _, _, rest = line.partition("| ")
        if '"timing_ms"' in rest:
            found.append(json.loads(rest)["timing_ms"])
    return found


def test_breakdown_points_at_the_slow_part_under_load(tmp_path: Path) -> None:
    slow_prefill, load_a, lines_a = run_stack(tmp_path / "a", "SGLANG_PD_REFENGINE_TEST_PREFILL_DELAY_S")
    slow_transfer, load_b, _ = run_stack(tmp_path / "b", "SGLANG_PD_REFENGINE_TEST_SLOW_TRANSFER_S")
    assert load_a >= LOAD and load_b >= LOAD, (load_a, load_b)  # the load ran beside the timed streams

    check_adds_up(slow_prefill)
    check_adds_up(slow_transfer)
    for _, parts in slow_prefill:
        assert blamed(parts) == "prefill" and parts["prefill"] > 0.9 * DELAY_S, parts
    for ttft, parts in slow_transfer:
        assert blamed(parts) == "transfer" and parts["transfer"] > 0.9 * DELAY_S, parts
        # The control: the sum without the transfer misses the client's TTFT by far more than 5 %.
        assert abs(shown(parts, leave_out="transfer") - ttft) / ttft > 0.3, (ttft, parts)
    # Each delay moves its own part (medians: the load shifts single readings).
    assert median(slow_prefill, "prefill") - median(slow_transfer, "prefill") > 0.6 * DELAY_S
    assert median(slow_transfer, "transfer") - median(slow_prefill, "transfer") > 0.6 * DELAY_S
    # And each run's verdict fails on the other's timings.
    assert all(blamed(parts) != "transfer" for _, parts in slow_prefill)
    assert all(blamed(parts) != "prefill" for _, parts in slow_transfer)

    # The router's request log line carries the same parts (ms).
    logged = logged_parts(lines_a)
    assert any(entry.get("prefill", 0) > 900 for entry in logged), logged[-5:]
