#!/usr/bin/env python
"""Abuse a running router the way one unauthenticated client on the network can, and measure
what other clients see meanwhile.

Each attack runs while a victim client opens a fresh connection for `GET /readiness` and
`GET /v1/models` ten times a second; the victims' statuses and latency percentiles are reported
per attack, with the router's resident memory and open descriptors (read from /proc, so run it
on the router's host):

- big-bodies: 16 connections each sending a 32 MiB body as fast as they can (declared length,
  then chunked);
- big-prompt: one 30 MB chat message, then one just under the body limit (parsed and sent on);
- idle: 20,000 TCP connections opened and left silent;
- slow-heads: 200 connections sending their request head at 1 byte/s;
- slow-bodies: 200 connections sending a 1 MiB body at 1 byte/s after a whole head;
- connection-hold: up to 10,100 connections open, each sending a whole head with `Content-Length:
  10` and no body, reopened when the router closes them, at most `--hold-rate` (500) new ones a
  second, for `--hold-seconds` (the router's connection cap held by one client);
- engine-flood (with `--engine URL`, the decode's): the same with idle connections to the engine's
  own port, while the victims also send one-token chat completions through the
  router and read `/readiness`, which must keep its decode (an engine at its connection cap
  answers a marked 503 that ejects nothing).

The attacker is one client on one address (127.0.0.1); the victims come from another
(`--victim-source`, default 127.0.0.2), as a second client would. For connection-hold and
engine-flood every victim request must get 200: p99 and failures are reported against the 1 s
bound (`victims_ok`).

Against a local stack (`sglang-pd up local-cpu` in another shell, as root for the descriptors):

    .venv/bin/python -m benchmarks.bench_abuse --router http://127.0.0.1:8000 \\
        --engine http://127.0.0.1:30001 --out out/abuse.json

Prints a table and writes JSON with the command, machine and date. The exit status is 1 when a
victim request failed or got other than 200 or 503 (other than 200, or a p99 over 1 s, in
connection-hold and engine-flood), or when an attacker's connection was still open after the
router's timeout plus a margin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

__all__ = ["AttackResult", "main"]

MIB = 1 << 20
VICTIM_INTERVAL_S = 0.1
# The router's shipped timeouts (deploy/common/http_limits.py) and the margin an attacker's connection may
# outlive them by before it counts as not cut.
HEAD_TIMEOUT_S = 10.0
BODY_GRACE_S = 10.0  # then 1 KiB/s: a body at 1 byte/s is cut at the end of the grace
CUT_MARGIN_S = 5.0
IDLE_PER_PROCESS = 15_000
IDLE_HOLD_S = 15.0
HOLD_CONNECTIONS = 10_100
VICTIM_P99_BOUND_S = 1.0
# Attacks in which victims must all get 200 within the bound (no 503 for load counts as served).
STRICT = ("connection-hold", "engine-flood")


@dataclass
class AttackResult:
    name: str
    seconds: float = 0.0
    victims: Counter[str] = field(default_factory=Counter)
    victim_latencies_s: list[float] = field(default_factory=list)
    attacker: Counter[str] = field(default_factory=Counter)  # how each attacker connection ended
    attacker_cut_s: list[float] = field(default_factory=list)  # when the router closed it
    rss_mb: dict[str, float] = field(default_factory=dict)
    descriptors: dict[str, int] = field(default_factory=dict)
    decodes_seen: list[int] = field(default_factory=list)  # /readiness's decode count, engine-flood

    @property
    def victims_bad(self) -> int:
        allowed = ("200",) if self.name in STRICT else ("200", "503")
        return sum(n for k, n in self.victims.items() if k not in allowed)

    def p99(self) -> float | None:
        lat = sorted(self.victim_latencies_s)
        return lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None

    @property
    def victims_ok(self) -> bool:
        p99 = self.p99()
        slow = self.name in STRICT and (p99 is None or p99 >= VICTIM_P99_BOUND_S)
        return not self.victims_bad and not slow and min(self.decodes_seen, default=1) >= 1

    def row(self) -> dict[str, object]:
        lat = sorted(self.victim_latencies_s)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(len(lat) * p))], 4) if lat else None

        cut = sorted(self.attacker_cut_s)
        return {
            "attack": self.name,
            "seconds": round(self.seconds, 1),
            "victims": dict(self.victims),
            "victim_p50_s": pct(0.5),
            "victim_p99_s": pct(0.99),
            "victim_max_s": round(lat[-1], 4) if lat else None,
            "attacker_endings": dict(self.attacker),
            "attacker_cut_after_s": {"min": round(cut[0], 2), "max": round(cut[-1], 2)} if cut else None,
            "router_rss_mb": self.rss_mb,
            "router_descriptors": self.descriptors,
            **({"readiness_decodes_min": min(self.decodes_seen)} if self.decodes_seen else {}),
            "victims_ok": self.victims_ok,
        }


def _listener_pids(port: int) -> list[int]:
    """The processes holding a listening TCP socket on `port` (from /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            if any(f"socket:[{i}]" in links for i in inodes):
                pids.append(int(proc.name))
    return pids


class RouterProcess:
    """Memory and descriptors of the router's serving processes."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _status_mb(self, key: str) -> float:
        total = 0
        for pid in self.pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(key):
                        total += int(line.split()[1])
        return round(total / 1024, 1)

    def rss_mb(self) -> float:
        return self._status_mb("VmRSS:")

    def high_water_mb(self) -> float:
        """The largest resident size since the process started (the kernel's, not sampled)."""
        return self._status_mb("VmHWM:")

    def descriptors(self) -> int:
        return sum(len(list(Path(f"/proc/{pid}/fd").iterdir())) for pid in self.pids if Path(f"/proc/{pid}").exists())


def _raise_descriptor_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


async def _victims(base: str, result: AttackResult, stop: asyncio.Event, source: str, model: str = "") -> None:
    """Fresh-connection requests from `source`, ten a second, until `stop`: GETs of /readiness and
    /v1/models, and with `model` also one-token chat completions (every third request)."""
    n = 0
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            transport = httpx.AsyncHTTPTransport(local_address=source)
            async with httpx.AsyncClient(timeout=30, transport=transport) as client:
                if model and n % 3 == 2:
                    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
                    resp = await client.post(base + "/v1/chat/completions", json=body)
                else:
                    resp = await client.get(base + ("/readiness", "/v1/models")[n % 3 % 2])
                    if resp.status_code == 200 and n % 3 == 0 and model:
                        result.decodes_seen.append(int(resp.json().get("decode", 0)))
            result.victims[str(resp.status_code)] += 1
        except httpx.HTTPError as exc:
            result.victims[type(exc).__name__] += 1
        result.victim_latencies_s.append(time.monotonic() - t0)
        n += 1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(VICTIM_INTERVAL_S):
                await stop.wait()


async def _until_answered(reader: asyncio.StreamReader, t0: float, result: AttackResult) -> None:
    """Wait for the router's answer to an attacker (or its closing the connection) and record it:
    the status line, and the time it came after the connection opened."""
    try:
        head = await reader.read(65536)
    except ConnectionResetError:
        # The router answered and closed while this client was still sending: the kernel resets
        # the connection and drops the answer before it is read.
        head = b"reset while sending"
    except ConnectionError:
        head = b""
    result.attacker_cut_s.append(time.monotonic() - t0)
    result.attacker[head.split(b"\r\n", 1)[0].decode(errors="replace")[:40] or "closed, no answer"] += 1


async def _run(
    name: str,
    base: str,
    router: RouterProcess,
    attack: Callable[[AttackResult], Awaitable[None]],
    victim_source: str,
    model: str = "",
) -> AttackResult:
    result = AttackResult(name)
    result.rss_mb["before"], result.descriptors["before"] = router.rss_mb(), router.descriptors()
    result.rss_mb["high_water_before"] = router.high_water_mb()
    stop = asyncio.Event()
    peak = {"rss": 0.0, "fds": 0}

    async def sample() -> None:
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], router.rss_mb())
            peak["fds"] = max(peak["fds"], router.descriptors())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    await stop.wait()

    t0 = time.monotonic()
    victims = _victims(base, result, stop, victim_source, model if name == "engine-flood" else "")
    tasks = [asyncio.ensure_future(victims), asyncio.ensure_future(sample())]
    try:
        await attack(result)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    result.seconds = time.monotonic() - t0
    await asyncio.sleep(2)  # what the router gives back once the attack ended
    result.rss_mb |= {"peak_sampled": peak["rss"], "high_water_after": router.high_water_mb(), "after": router.rss_mb()}
    result.descriptors |= {"peak": peak["fds"], "after": router.descriptors()}
    return result


def _head(host: str, length: int | None, *, chunked: bool = False) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", f"Host: {host}".encode(), b"Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}".encode())
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def attacks(
    host: str,
    port: int,
    idle: int,
    *,
    engine: tuple[str, int] | None = None,
    hold_s: float = 30.0,
    hold_rate: float = 500.0,
) -> dict[str, Callable[[AttackResult], Awaitable[None]]]:
    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    async def idle_connections(result: AttackResult) -> None:
        # One process may hold fewer descriptors than the attack needs (20,000 here, the router's
        # own limit too): the connections are held by child processes of at most IDLE_PER_PROCESS.
        shares = [min(IDLE_PER_PROCESS, idle - i) for i in range(0, idle, IDLE_PER_PROCESS)]
        argv = [sys.executable, "-m", "benchmarks.bench_abuse", "--router", f"http://{host}:{port}"]
        children = [
            await asyncio.create_subprocess_exec(*argv, "--hold-idle", str(n), stdout=asyncio.subprocess.PIPE)
            for n in shares
        ]
        for child in children:
            assert child.stdout is not None
            for key, n in json.loads(await child.stdout.readline()).items():
                result.attacker[key] += n
        await asyncio.sleep(IDLE_HOLD_S)  # the victims run against the held connections
        for child in children:
            child.terminate()
            await child.wait()

    async def slow(result: AttackResult, head: bytes, trickle: bytes, n: int) -> None:
        async def one() -> None:
            reader, writer = await connect()
            t0 = time.monotonic()
            answered = asyncio.ensure_future(_until_answered(reader, t0, result))
            with contextlib.suppress(ConnectionError):
                writer.write(head)
                for byte in trickle:
                    if answered.done():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.wait({answered}, timeout=1.0)
            await answered
            writer.close()

        await asyncio.gather(*(one() for _ in range(n)))

    async def slow_heads(result: AttackResult) -> None:
        await slow(result, b"", _head(host, 2) + b"{}", 200)

    async def slow_bodies(result: AttackResult) -> None:
        await slow(result, _head(host, MIB), b'{"messages": "' + b"x" * (MIB - 16) + b'"}', 200)

    async def push(result: AttackResult, head: bytes, body: bytes, *, chunked: bool = False) -> None:
        """Send `head`, then `body` in 1 MiB pieces as fast as the router takes them, until it answers."""
        reader, writer = await connect()
        t0 = time.monotonic()
        answered = asyncio.ensure_future(_until_answered(reader, t0, result))
        writer.write(head)
        with contextlib.suppress(ConnectionError):
            for at in range(0, len(body), MIB):
                if answered.done():
                    break
                piece = body[at : at + MIB]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()
        await answered
        writer.close()

    async def big_bodies(result: AttackResult) -> None:
        body = b"x" * (32 * MIB)
        for chunked in (False, True):
            head = _head(host, None if chunked else len(body), chunked=chunked)
            await asyncio.gather(*(push(result, head, body, chunked=chunked) for _ in range(16)))

    async def big_prompt(result: AttackResult) -> None:
        for size in (30_000_000, 8 * MIB - 4096):
            body = json.dumps({"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 1}).encode()
            await push(result, _head(host, len(body)), body)
            await asyncio.sleep(3)

    async def hold(result: AttackResult, target: tuple[str, int], head: bytes, n: int) -> None:
        """Up to `n` connections to `target` open at once, each sending `head` and then nothing; one
        the server closes is opened again, at most `hold_rate` new connections a second in all,
        until `hold_s` has passed."""
        deadline = time.monotonic() + hold_s
        slots = asyncio.Semaphore(n)
        tasks: set[asyncio.Task[None]] = set()

        async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                t0 = time.monotonic()
                with contextlib.suppress(ConnectionError):
                    writer.write(head)
                answered = asyncio.ensure_future(_until_answered(reader, t0, result))
                await asyncio.wait({answered}, timeout=max(0.0, deadline - time.monotonic()))
                if not answered.done():
                    answered.cancel()
                    result.attacker["held to the end"] += 1
                writer.close()
            finally:
                slots.release()

        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await slots.acquire()
                    try:
                        reader, writer = await asyncio.open_connection(*target)
                    except OSError as exc:
                        result.attacker[f"connect: {type(exc).__name__}"] += 1
                        slots.release()
                    else:
                        task = asyncio.ensure_future(one(reader, writer))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    await asyncio.sleep(1.0 / hold_rate)
        await asyncio.gather(*tasks)

    async def connection_hold(result: AttackResult) -> None:
        await hold(result, (host, port), _head(host, 10), HOLD_CONNECTIONS)

    async def engine_flood(result: AttackResult) -> None:
        assert engine is not None
        await hold(result, engine, b"", HOLD_CONNECTIONS)

    found: dict[str, Callable[[AttackResult], Awaitable[None]]] = {
        # memory first, so that its figures start from the router's own baseline
        "big-bodies": big_bodies,
        "big-prompt": big_prompt,
        "idle": idle_connections,
        "slow-heads": slow_heads,
        "slow-bodies": slow_bodies,
        "connection-hold": connection_hold,
    }
    if engine is not None:
        found["engine-flood"] = engine_flood
    return found


async def hold_idle(host: str, port: int, n: int) -> None:
    """Open `n` silent connections, print how many opened (one JSON line), hold them until killed."""
    writers, errors = [], Counter[str]()
    for i in range(0, n, 500):
        batch = [asyncio.open_connection(host, port) for _ in range(min(500, n - i))]
        for opened in await asyncio.gather(*batch, return_exceptions=True):
            if isinstance(opened, BaseException):
                errors[type(opened).__name__] += 1
            else:
                writers.append(opened[1])
    print(json.dumps({"opened": len(writers), **errors}), flush=True)
    await asyncio.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", required=True, help="the router's base URL (on this host)")
    ap.add_argument("--idle", type=int, default=20_000, help="idle connections of the first attack")
    ap.add_argument("--engine", help="the decode engine's base URL (on this host): adds engine-flood")
    ap.add_argument("--victim-source", default="127.0.0.2", help="the victims' source address (default 127.0.0.2)")
    ap.add_argument("--hold-seconds", type=float, default=30.0, help="length of connection-hold and engine-flood")
    ap.add_argument(
        "--hold-rate", type=float, default=500.0, help="new connections a second in connection-hold and engine-flood"
    )
    ap.add_argument("--only", action="append", help="run only this attack (repeatable)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--hold-idle", type=int, help=argparse.SUPPRESS)  # a child of the idle attack
    args = ap.parse_args(argv)
    url = urlsplit(args.router)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    if args.hold_idle:
        _raise_descriptor_limit(args.hold_idle + 256)
        asyncio.run(hold_idle(host, port, args.hold_idle))
        return 0
    pids = _listener_pids(port)
    if not pids:
        ap.error(f"no process on this host listens on port {port}; start the router first (sglang-pd up).")
    router = RouterProcess(pids)
    _raise_descriptor_limit(2 * HOLD_CONNECTIONS + 1024)
    engine = None
    if args.engine:
        e = urlsplit(args.engine)
        engine = (e.hostname or "127.0.0.1", e.port or 80)
    model = httpx.get(args.router + "/v1/models", timeout=30).json()["data"][0]["id"] if engine else ""
    load_before = os.getloadavg()
    results = []
    for name, attack in attacks(
        host, port, args.idle, engine=engine, hold_s=args.hold_seconds, hold_rate=args.hold_rate
    ).items():
        if args.only and name not in args.only:
            continue
        result = asyncio.run(_run(name, args.router, router, attack, args.victim_source, model))
        results.append(result)
        print(json.dumps(result.row()))
    limits = {"slow-heads": HEAD_TIMEOUT_S, "slow-bodies": BODY_GRACE_S}
    not_cut = [
        r.name for r in results if r.name in limits and max(r.attacker_cut_s, default=0) > limits[r.name] + CUT_MARGIN_S
    ]
    bad = [r.name for r in results if not r.victims_ok]
    print(f"victims failed during: {bad or 'none'}; attackers not cut in time: {not_cut or 'none'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([sys.executable, "-m", "benchmarks.bench_abuse", *(argv or sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "router_pids": pids,
            "results": [r.row() for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if bad or not_cut else 0


if __name__ == "__main__":
    raise SystemExit(main())
