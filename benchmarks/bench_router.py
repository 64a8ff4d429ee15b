#!/usr/bin/env python
"""Benchmark the PD router against going direct to the workers and against smg (a benchmark, not a test).

Protocol-faithful test workers (tests/support/router_worker_server.py) run on loopback; a bounded,
closed-loop load generator (aiohttp) sends OpenAI chat requests, streaming and not, at each
concurrency, through each target in turn:

- direct: the load generator does the PD fan-out itself (bootstrap fields, prefill and decode at
  once, decode's answer), i.e. the same worker work as behind a router, minus the router hop.
  The decode worker fetches the KV hand-off from the prefill by room, so decode alone cannot
  answer a PD request: this is the "direct to decode" baseline of a PD system.
- router: `sglang-pd router` (this package), as a separate process.
- smg: `smg launch --pd-disaggregation` (PyPI smg 1.13.0), when installed.

All targets run at once (idle when not measured); they take turns cell by cell in a rotating
order, each cell is measured --rounds times and the median round is reported, so that a noisy,
shared machine biases no target.

Prints a table and writes JSON with the run's command, machine and date. Targets: router-added
p50 at concurrency 1 <= 0.5 ms; router throughput >= 1.0 x smg's at each concurrency above 1,
unary and streaming; zero errors. The exit status is 1 when there were errors or the added p50
missed its target. Run it from the repository root (the test workers are imported from
`tests.support`):

    .venv/bin/python -m benchmarks.bench_router --out out/bench_router.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from sglang_pd.deploy.common.procs import Child, spawn
from tests.support.polling import free_port
from tests.support.router_worker_server import WorkerProcess, start_workers

CHAT = "/v1/chat/completions"
# What the router is held to: its added p50 at concurrency 1 (over going direct), and its
# throughput against smg's at every concurrency above 1, unary and streaming.
ADDED_P50_TARGET_MS = 0.5
THROUGHPUT_TARGET = 1.0
TARGETS = ("direct", "router", "smg")


@dataclass
class Cell:
    target: str
    stream: bool
    concurrency: int
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    ttfb_p50_ms: float = 0.0
    cpu_ms_per_req: float = 0.0  # the router process's CPU (user + system, all threads) per request
    # The test workers' CPU per request (all prefills and decodes): a target that makes the workers
    # work harder (more reads per request, new connections) slows every target on a shared machine.
    worker_cpu_ms_per_req: float = 0.0
    error_samples: list[str] = field(default_factory=list)


def _with_children(pids: list[int]) -> list[int]:
    """`pids` and their children (a router process group's serving processes), from Linux /proc."""
    found = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return found


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of processes (all their threads) so far, from Linux /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _cpu_during(pids: list[int], start: float, stop: float) -> float:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    pids = _with_children(pids)
    before = _cpu_seconds(pids)
    await asyncio.sleep(max(0.0, stop - time.perf_counter()))
    return _cpu_seconds(pids) - before


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _body(stream: bool, tokens: int) -> dict[str, Any]:
    return {
        "model": "test-model",
        "messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
        "max_tokens": tokens,
        "stream": stream,
    }


Sender = Callable[[aiohttp.ClientSession, bool], Awaitable[float]]


def _check(status: int, body: bytes, stream: bool) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
    if stream and not body.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"stream did not end with [DONE]: {body[-200:]!r}")
    if b'"error"' in body:
        raise RuntimeError(f"error in answer: {body[:200]!r}")


async def _read_answer(resp: aiohttp.ClientResponse, stream: bool, started: float) -> float:
    """Read one answer whole, check it, and return the time to its first byte."""
    if stream:
        ttfb, chunks = 0.0, []
        async for chunk in resp.content.iter_any():
            if not ttfb:
                ttfb = time.perf_counter() - started
            chunks.append(chunk)
        body = b"".join(chunks)
    else:
        body = await resp.read()
        ttfb = time.perf_counter() - started
    _check(resp.status, body, stream)
    return ttfb


def via_url(url: str, tokens: int) -> Sender:
    async def send(session: aiohttp.ClientSession, stream: bool) -> float:
        started = time.perf_counter()
        async with session.post(url + CHAT, json=_body(stream, tokens)) as resp:
            return await _read_answer(resp, stream, started)

    return send


def direct(prefills: list[WorkerProcess], decodes: list[WorkerProcess], tokens: int) -> Sender:
    counter = iter(range(10**12))

    async def send(session: aiohttp.ClientSession, stream: bool) -> float:
        i = next(counter)
        p, d = prefills[i % len(prefills)], decodes[i % len(decodes)]
        body = _body(stream, tokens)
        body.update(
            bootstrap_host="127.0.0.1",
            bootstrap_port=p.bootstrap_port,
            bootstrap_room=random.getrandbits(63),
            rid=f"direct-{os.getpid()}-{i}",  # unique across load generator processes
        )
        started = time.perf_counter()

        async def prefill() -> None:
            async with session.post(p.url + CHAT, json=body) as resp:
                await resp.read()

        prefill_task = asyncio.ensure_future(prefill())
        async with session.post(d.url + CHAT, json=body) as resp:
            ttfb = await _read_answer(resp, stream, started)
        await prefill_task
        return ttfb

    return send


@dataclass
class _Drive:
    """What one load generator process measured in a cell."""

    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


async def _drive(send: Sender, stream: bool, concurrency: int, measure_from: float, stop_at: float) -> _Drive:
    """`concurrency` closed loops of requests until `stop_at`; what started after `measure_from`
    counts (time.perf_counter: the system-wide monotonic clock, the same in every process)."""
    out = _Drive()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def loop() -> None:
            while True:
                started = time.perf_counter()
                if started >= stop_at:
                    return
                try:
                    ttfb = await send(session, stream)
                except Exception as exc:
                    if started >= measure_from:
                        out.errors += 1
                        if len(out.error_samples) < 3:
                            out.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                if started >= measure_from:
                    out.latencies.append(time.perf_counter() - started)
                    out.ttfbs.append(ttfb)

        await asyncio.gather(*[loop() for _ in range(concurrency)])
    return out


def _drive_in_child(
    conn: Any, send: Sender, stream: bool, concurrency: int, measure_from: float, stop_at: float
) -> None:
    conn.send(asyncio.run(_drive(send, stream, concurrency, measure_from, stop_at)))
    conn.close()


def measure_cell(
    send: Sender,
    cell: Cell,
    duration: float,
    warmup: float,
    pids: list[int],
    loadgen_processes: int = 1,
    worker_pids: list[int] | None = None,
) -> None:
    """Fill `cell` with one closed-loop measurement. With `loadgen_processes` > 1 the cell's
    concurrency is split over that many forked load generator processes (one Python process
    tops out near 6000 requests/s), whose results are merged."""
    measure_from = time.perf_counter() + warmup
    stop_at = measure_from + duration
    shares = max(1, min(loadgen_processes, cell.concurrency))
    if shares == 1:

        async def alone() -> tuple[_Drive, float, float]:
            cpu = asyncio.ensure_future(_cpu_during(pids, measure_from, stop_at))
            workers_cpu = asyncio.ensure_future(_cpu_during(worker_pids or [], measure_from, stop_at))
            drive = await _drive(send, cell.stream, cell.concurrency, measure_from, stop_at)
            return drive, await cpu, await workers_cpu

        drive, cpu, workers_cpu = asyncio.run(alone())
        parts = [drive]
    else:
        ctx = multiprocessing.get_context("fork")
        pipes, procs = [], []
        for i in range(shares):
            share = cell.concurrency // shares + (1 if i < cell.concurrency % shares else 0)
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_drive_in_child, args=(writer, send, cell.stream, share, measure_from, stop_at))
            proc.start()
            writer.close()
            pipes.append(reader)
            procs.append(proc)

        async def watch() -> tuple[float, float]:
            both = _cpu_during(pids, measure_from, stop_at), _cpu_during(worker_pids or [], measure_from, stop_at)
            cpu, workers_cpu = await asyncio.gather(*both)
            return cpu, workers_cpu

        cpu, workers_cpu = asyncio.run(watch())
        parts = [reader.recv() for reader in pipes]
        for proc in procs:
            proc.join()
    latencies = [x for part in parts for x in part.latencies]
    ttfbs = [x for part in parts for x in part.ttfbs]
    cell.errors = sum(part.errors for part in parts)
    cell.error_samples = [e for part in parts for e in part.error_samples][:3]
    cell.seconds = duration
    cell.requests = len(latencies)
    cell.rps = cell.requests / cell.seconds
    cell.p50_ms = _pct(latencies, 0.50)
    cell.p90_ms = _pct(latencies, 0.90)
    cell.p99_ms = _pct(latencies, 0.99)
    cell.ttfb_p50_ms = _pct(ttfbs, 0.50)
    cell.cpu_ms_per_req = cpu * 1000 / cell.requests if cell.requests and pids else 0.0
    cell.worker_cpu_ms_per_req = workers_cpu * 1000 / cell.requests if cell.requests and worker_pids else 0.0


@contextlib.contextmanager
def _process(name: str, cmd: list[str], ready_url: str, log: Path) -> Iterator[Child]:
    with log.open("wb") as out:
        child = spawn(name, cmd, stdout=out, stderr=subprocess.STDOUT, text=False)
    try:
        child.wait_http(ready_url, 60)
        yield child
    finally:
        child.stop()


def _pd_flags(prefills: list[WorkerProcess], decodes: list[WorkerProcess]) -> list[str]:
    """The worker flags smg and our router share."""
    flags = ["--host", "127.0.0.1", "--policy", "round_robin"]
    for p in prefills:
        flags += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        flags += ["--decode", d.url]
    return flags


def _router_cmd(
    port: int, prefills: list[WorkerProcess], decodes: list[WorkerProcess], processes: int = 1
) -> list[str]:
    cli = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--port", str(port), "--log-level", "warning"]
    return [*cli, "--processes", str(processes), *_pd_flags(prefills, decodes)]


def _router_target(processes: int) -> str:
    return "router" if processes == 1 else f"router{processes}p"


def _smg_cmd(smg: str, port: int, prefills: list[WorkerProcess], decodes: list[WorkerProcess]) -> list[str]:
    cli = [smg, "launch", "--pd-disaggregation", "--port", str(port), "--log-level", "warn", "--disable-retries"]
    # Its metrics listener defaults to 0.0.0.0:29000, which another smg on this machine may hold.
    cli += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return cli + _pd_flags(prefills, decodes)


def _find_smg() -> str | None:
    local = Path(sys.executable).parent / "smg"
    return str(local) if local.exists() else shutil.which("smg")


def _table(cells: list[Cell], direct_p50: dict[tuple[bool, int], float]) -> str:
    head = (
        f"{'target':<9} {'stream':<6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'ttfb p50':>9} {'+p50 vs direct':>15} {'cpu ms/req':>10} {'workers ms/req':>14} {'errors':>6}"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        added = c.p50_ms - direct_p50.get((c.stream, c.concurrency), c.p50_ms)
        lines.append(
            f"{c.target:<9} {('yes' if c.stream else 'no'):<6} {c.concurrency:>4} {c.rps:>9.0f} {c.p50_ms:>8.2f} "
            f"{c.p90_ms:>8.2f} {c.p99_ms:>8.2f} {c.ttfb_p50_ms:>9.2f} {added:>+15.2f} "
            f"{(f'{c.cpu_ms_per_req:.3f}' if c.cpu_ms_per_req else '-'):>10} "
            f"{(f'{c.worker_cpu_ms_per_req:.3f}' if c.worker_cpu_ms_per_req else '-'):>14} {c.errors:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=2.0, help="measured seconds per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per cell; the median is reported")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--prefills", type=int, default=1)
    parser.add_argument("--decodes", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer (streamed as 8 SSE events)")
    parser.add_argument(
        "--loadgen-processes",
        type=int,
        default=1,
        metavar="K",
        help="load generator processes sharing each cell's concurrency (for hosts with many cores)",
    )
    parser.add_argument(
        "--router-processes",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="measure the router with each of these --processes values (targets router, router2p, ...)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench_router.json"))
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    smg = _find_smg()
    targets = [t for t in args.targets if t != "smg" or smg]
    routers = {_router_target(n): n for n in args.router_processes} if "router" in targets else {}
    at = targets.index("router") if routers else 0
    targets[at : at + 1] = list(routers) if routers else targets[at : at + 1]
    if "smg" in args.targets and not smg:
        print("smg is not installed (pip install smg==1.13.0): skipping it.", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent
    prefills, decodes = start_workers(args.prefills, args.decodes, no_log=True)
    cells: list[Cell] = []
    meta: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.bench_router", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        or None,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": sys.version.split()[0],
        "prefills": args.prefills,
        "decodes": args.decodes,
        "tokens": args.tokens,
        "router_processes": args.router_processes,
        "loadgen_processes": args.loadgen_processes,
        "duration_s": args.duration,
        "smg": subprocess.run([smg, "--version"], capture_output=True, text=True).stdout.strip() if smg else None,
    }
    senders: dict[str, Sender] = {}
    pids: dict[str, list[int]] = {"direct": []}
    try:
        with contextlib.ExitStack() as stack:
            for target in targets:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                if target == "direct":
                    senders[target] = direct(prefills, decodes, args.tokens)
                    continue
                if target in routers:
                    cmd = _router_cmd(port, prefills, decodes, routers[target])
                else:
                    assert smg is not None
                    cmd = _smg_cmd(smg, port, prefills, decodes)
                child = stack.enter_context(_process(target, cmd, url + "/readiness", logs / f"bench_{target}.log"))
                pids[target] = [child.pid]
                senders[target] = via_url(url, args.tokens)
            time.sleep(1.0)
            # The machine is shared and noisy: targets take turns cell by cell (in a rotating
            # order), each cell is measured `rounds` times, and the median round is reported.
            rounds: dict[tuple[str, bool, int], list[Cell]] = {}
            for r in range(args.rounds):
                for stream in (False, True):
                    for conc in args.concurrency:
                        order = targets[r % len(targets) :] + targets[: r % len(targets)]
                        for target in order:
                            cell = Cell(target, stream, conc)
                            measure_cell(
                                senders[target],
                                cell,
                                args.duration,
                                args.warmup,
                                pids[target],
                                args.loadgen_processes,
                                worker_pids=[w.child.pid for w in prefills + decodes],
                            )
                            rounds.setdefault((target, stream, conc), []).append(cell)
                            print(
                                f"  round {r} {target:<9} stream={stream!s:<5} c={conc:<3} {cell.rps:8.0f} req/s  "
                                f"p50 {cell.p50_ms:7.2f} ms  router {cell.cpu_ms_per_req:.3f} workers "
                                f"{cell.worker_cpu_ms_per_req:.3f} ms/req  errors {cell.errors}",
                                file=sys.stderr,
                                flush=True,
                            )
    finally:
        for w in prefills + decodes:
            w.stop()
    for target in targets:
        for stream in (False, True):
            for conc in args.concurrency:
                runs = rounds[target, stream, conc]
                median = sorted(runs, key=lambda c: c.rps)[len(runs) // 2]
                merged = Cell(
                    target,
                    stream,
                    conc,
                    requests=sum(c.requests for c in runs),
                    errors=sum(c.errors for c in runs),
                    seconds=sum(c.seconds for c in runs),
                    rps=median.rps,
                    p50_ms=statistics.median(c.p50_ms for c in runs),
                    p90_ms=statistics.median(c.p90_ms for c in runs),
                    p99_ms=statistics.median(c.p99_ms for c in runs),
                    ttfb_p50_ms=statistics.median(c.ttfb_p50_ms for c in runs),
                    cpu_ms_per_req=statistics.median(c.cpu_ms_per_req for c in runs),
                    worker_cpu_ms_per_req=statistics.median(c.worker_cpu_ms_per_req for c in runs),
                    error_samples=[e for c in runs for e in c.error_samples][:3],
                )
                cells.append(merged)
    # The machine's load while measuring (1, 5, 15 min): the run shares its cores with whatever else runs.
    meta["load_average_at_end"] = os.getloadavg()
    meta["rounds"] = {
        f"{t}|{'stream' if st else 'unary'}|{c}": [asdict(x) for x in runs] for (t, st, c), runs in rounds.items()
    }

    direct_p50 = {(c.stream, c.concurrency): c.p50_ms for c in cells if c.target == "direct"}
    by = {(c.target, c.stream, c.concurrency): c for c in cells}
    verdict: dict[str, Any] = {}
    for target in [*routers, "smg"]:
        if (target, False, 1) in by and ("direct", False, 1) in by:
            added = by[target, False, 1].p50_ms - by["direct", False, 1].p50_ms
            verdict[f"{target}_added_p50_ms_c1"] = round(added, 3)
            if target != "smg":
                verdict[f"{target}_added_p50_ok"] = added <= ADDED_P50_TARGET_MS
    for target in routers:
        for stream in (False, True):
            key = "stream" if stream else "unary"
            for conc in args.concurrency:
                if conc > 1 and (target, stream, conc) in by and ("smg", stream, conc) in by:
                    router, smg_cell = by[target, stream, conc], by["smg", stream, conc]
                    # The machine's speed drifts between rounds: compare router and smg within
                    # each round (measured back to back) and take the median of those ratios.
                    pairs = zip(rounds[target, stream, conc], rounds["smg", stream, conc], strict=True)
                    ratio = statistics.median(r.rps / max(s.rps, 1e-9) for r, s in pairs)
                    verdict[f"{target}_throughput_ratio_vs_smg_c{conc}_{key}"] = round(ratio, 3)
                    verdict[f"{target}_throughput_ratio_ok_c{conc}_{key}"] = ratio >= THROUGHPUT_TARGET
                    if router.cpu_ms_per_req and smg_cell.cpu_ms_per_req:
                        verdict[f"{target}_cpu_per_request_ratio_vs_smg_c{conc}_{key}"] = round(
                            router.cpu_ms_per_req / smg_cell.cpu_ms_per_req, 3
                        )
    verdict["errors"] = sum(c.errors for c in cells)
    verdict["zero_errors"] = verdict["errors"] == 0

    print()
    print(_table(cells, direct_p50))
    print()
    print(json.dumps(verdict, indent=1))
    args.out.write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells], "verdict": verdict}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    ok = verdict["zero_errors"] and all(verdict.get(f"{t}_added_p50_ok", True) for t in routers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
