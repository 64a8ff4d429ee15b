#!/usr/bin/env python
"""The router with and without the coalescing transport (deploy/router/api/connection.py: a
response's head leaves with the bytes that follow it), interleaved (a benchmark, not a test).

Two router processes in front of the same test workers (tests/support/router_worker_server.py):
one as shipped, one with `RouterProtocol.connection_made` giving uvicorn the plain transport. They
take turns, round by round in alternating order, under the same closed-loop load (aiohttp, unary
chat requests). Each cell reports throughput and the router process's CPU time per request (from
/proc), the figure the change is about. Prints a table and writes JSON with the run's command,
machine, load and date. Run from the repository root:

    .venv/bin/python -m benchmarks.bench_router_coalescing --out out/bench_router_coalescing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from tests.support.polling import free_port
from tests.support.router_worker_server import WorkerProcess, start_workers

# The router as shipped, but uvicorn gets the plain transport: two writes per unary answer.
_PLAIN = """
import sys
from sglang_pd.deploy.common.http_limits import LimitedProtocol
from sglang_pd.deploy.router.api import connection

def connection_made(self, transport):
    self._gone = self.loop.create_future()
    LimitedProtocol.connection_made(self, transport)

connection.RouterProtocol.connection_made = connection_made
from sglang_pd.deploy.router.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start(plain: bool, prefill: WorkerProcess, decode: WorkerProcess) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    flags = ["--port", str(port), "--host", "127.0.0.1", "--log-level", "warning",
             "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url]  # fmt: skip
    head = ["-c", _PLAIN] if plain else ["-m", "sglang_pd.deploy.router.cli"]
    proc = subprocess.Popen([sys.executable, *head, *flags])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the router at {url} was not ready within 60 s")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _cell(url: str, body: dict[str, Any], concurrency: int, seconds: float) -> tuple[int, int]:
    ok = errors = 0
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal ok, errors
            while time.monotonic() < end:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        ok += 1
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per cell")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("out/bench_router_coalescing.json"))
    args = parser.parse_args(argv)
    command = [Path(sys.executable).name, "-m", "benchmarks.bench_router_coalescing", *(argv or sys.argv[1:])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta: dict[str, Any] = {
        "command": " ".join(command),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit,
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "concurrency": args.concurrency,
        "duration_s": args.duration,
    }  # fmt: skip
    (prefill,), (decode,) = start_workers(1, 1, no_log=True)
    routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    rounds: dict[str, list[dict[str, float]]] = {"coalescing": [], "plain": []}
    try:
        routers = {"coalescing": _start(False, prefill, decode), "plain": _start(True, prefill, decode)}
        model = httpx.get(routers["coalescing"][1] + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
        for r in range(args.rounds):
            for name in ("coalescing", "plain") if r % 2 == 0 else ("plain", "coalescing"):
                proc, url = routers[name]
                before = _cpu_s(proc.pid)
                ok, errors = asyncio.run(_cell(url, body, args.concurrency, args.duration))
                cpu_ms = (_cpu_s(proc.pid) - before) * 1000 / max(ok, 1)
                rounds[name].append({"rps": ok / args.duration, "cpu_ms_per_req": cpu_ms, "errors": errors})
                print(f"  round {r} {name:<10} {ok / args.duration:7.0f} req/s  {cpu_ms:.3f} cpu ms/req  "
                      f"errors {errors}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for proc, _ in routers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        prefill.stop()
        decode.stop()
    meta["load_average_at_end"] = os.getloadavg()
    summary = {
        name: {
            "median_rps": statistics.median(c["rps"] for c in cells),
            "median_cpu_ms_per_req": round(statistics.median(c["cpu_ms_per_req"] for c in cells), 4),
            "errors": sum(int(c["errors"]) for c in cells),
        }
        for name, cells in rounds.items()
    }
    print(f"{'router':<11} {'req/s':>8} {'cpu ms/req':>11} {'errors':>6}")
    for name, s in summary.items():
        print(f"{name:<11} {s['median_rps']:>8.0f} {s['median_cpu_ms_per_req']:>11.4f} {s['errors']:>6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(s["errors"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
