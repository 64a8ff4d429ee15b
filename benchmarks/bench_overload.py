#!/usr/bin/env python
"""Overload a running PD stack with concurrent streamed chats and count how every request ended.

N clients (default 64) each send streamed chat completions back to back for a fixed time; every
request is sorted by how it ended: 200 with a whole answer (`[DONE]` after a finish reason), 200
cut by an error event, or the HTTP status it got (429 and 503 are the router's answers for load,
with Retry-After). After the load the prefill and decode engines' metrics are read once they
settle: bootstrap rooms, KV pages and running requests must all return to 0.

Against a local stack (`sglang-pd up local-cpu` in another shell):

    .venv/bin/python -m benchmarks.bench_overload --router http://127.0.0.1:8000 \\
        --prefill http://127.0.0.1:30000 --decode http://127.0.0.1:30001 --out out/overload.json

With `--attack`, one client (127.0.0.1) attacks the admission instead while `--victims` clients
(8) from another address (`--victim-source`, 127.0.0.2) send small chat completions (a short
prompt, `--victim-max-tokens` 4) back to back for `--seconds`:

- none: no attacker (the victims' own latency on this machine, to compare with);
- starvation: 3 streamed chats with `max_tokens` 3,860 at a time, again as each ends (the whole
  decode pool, were each reserved whole);
- head-of-line: one 60 KB prompt (past the context) with `max_tokens` 64 at a time, again as each
  ends (such a prompt once sat at the head of the router's queue and held every request behind it).

The victims ask for the router's timing breakdown (`x-sglpd-timing: 1`), so that the time they
waited in the router's admission queue is read from each answer's Server-Timing apart from the
engines' own time. Every victim request must end with 200 and the victims' p99 admission wait stay
under 1 s (`victims_ok`); their end-to-end p99 is reported beside it, and on CPU engines it is
mostly the engines' compute, which the attacker's requests share. On engines fast enough for it
(sglang on a GPU), `--end-to-end` holds that p99 to the same 1 s (`victims_end_to_end_ok`), and
`--starvation-streams`/`--starvation-max-tokens` size the starvation attack to a larger pool.

    .venv/bin/python -m benchmarks.bench_overload --router http://127.0.0.1:8000 \\
        --prefill http://127.0.0.1:30000 --decode http://127.0.0.1:30001 --attack starvation \\
        --attack head-of-line --seconds 60 --out out/admission.json

Prints a table and writes JSON with the command, machine, load and date. The exit status is 1 when
a request ended other than with 200, 429 or 503, when a 200 stream was cut, when a victim failed or
its p99 admission wait (with `--end-to-end`, also its end-to-end p99) reached 1 s, or when the
engines kept rooms, pages or requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["LoadResult", "engine_leftovers", "run_load"]

# Answers a loaded router may give besides a whole 200: both carry Retry-After.
LOAD_STATUSES = frozenset({429, 503})
# Engine gauges that must be back at 0 once no request is in flight.
VICTIM_P99_BOUND_S = 1.0
ATTACKS = ("none", "starvation", "head-of-line")
# The starvation attack as first reported: 3 streams whose max_tokens, reserved whole, filled the
# local-cpu decode's 11,648-token pool. On a larger pool, size it with --starvation-streams.
STARVATION_STREAMS = 3
STARVATION_MAX_TOKENS = 3860
LEFTOVER_GAUGES = (
    "sglang_pd_refengine_bootstrap_rooms",
    "sglang_pd_refengine_kv_pages_used",
    "sglang_pd_refengine_running_requests",
    "sglang_pd_refengine_waiting_requests",
)


@dataclass
class LoadResult:
    clients: int
    seconds: float
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies_s: dict[str, list[float]] = field(default_factory=dict)  # by outcome
    retry_after_missing: int = 0  # 429/503 answers without Retry-After
    queue_s: list[float] = field(default_factory=list)  # admission waits, from Server-Timing
    samples: dict[str, str] = field(default_factory=dict)  # one body per bad outcome

    @property
    def bad(self) -> int:
        """Requests that ended neither whole with 200 nor with 429/503."""
        return sum(n for k, n in self.outcomes.items() if k != "200" and k not in {str(s) for s in LOAD_STATUSES})

    def record(self, outcome: str, t0: float) -> None:
        self.outcomes[outcome] += 1
        self.latencies_s.setdefault(outcome, []).append(time.monotonic() - t0)

    def summary(self) -> dict[str, object]:
        def percentiles(values: list[float]) -> dict[str, float]:
            lat = sorted(values)
            at = {f"p{p}": lat[min(len(lat) - 1, int(len(lat) * p / 100))] for p in (50, 99)}
            return {k: round(v, 3) for k, v in {**at, "mean": statistics.fmean(lat)}.items()}

        return {
            "clients": self.clients,
            "seconds": self.seconds,
            "requests": sum(self.outcomes.values()),
            "outcomes": dict(sorted(self.outcomes.items())),
            "latency_s": {k: percentiles(v) for k, v in sorted(self.latencies_s.items())},
            "retry_after_missing": self.retry_after_missing,
            "samples": self.samples,
        }


def _queue_s(server_timing: str) -> float | None:
    """The `queue` part of the router's Server-Timing header, in seconds."""
    for part in server_timing.split(","):
        name, _, rest = part.strip().partition(";dur=")
        if name == "queue" and rest:
            return float(rest) / 1000
    return None


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object], result: LoadResult) -> None:
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if (queued := _queue_s(resp.headers.get("server-timing", ""))) is not None:
                result.queue_s.append(queued)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                key = str(resp.status_code)
                if resp.status_code in LOAD_STATUSES and "retry-after" not in resp.headers:
                    result.retry_after_missing += 1
                result.samples.setdefault(key, text[:300])
                result.record(key, t0)
                return
            finished = done = False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.samples.setdefault("200+error", line[:300])
                        result.record("200+error", t0)
                        return
                    finished = finished or any(c.get("finish_reason") for c in event.get("choices") or [])
    except httpx.HTTPError as exc:
        result.samples.setdefault("transport", f"{type(exc).__name__}: {exc}")
        result.record("transport", t0)
        return
    result.record("200" if finished and done else "200+cut", t0)


async def run_load(
    router: str,
    *,
    clients: int = 64,
    seconds: float = 60.0,
    max_tokens: int = 32,
    headers: dict[str, str] | None = None,
) -> LoadResult:
    """`clients` closed-loop streamed chat clients against `router` for `seconds`."""
    result = LoadResult(clients, seconds)
    url = f"{router}/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    deadline = time.monotonic() + seconds

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < deadline:
            body = {
                "messages": [{"role": "user", "content": f"Client {i}, request {n}: tell me about the sea."}],
                "max_tokens": max_tokens,
                "stream": True,
            }
            await _one(client, url, body, result)
            n += 1

    # The client's own timeout is far above the router's: every request must end by the router's word.
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
    return result


async def run_attack(
    router: str,
    attack: str,
    *,
    seconds: float = 60.0,
    victims: int = 8,
    victim_max_tokens: int = 4,
    victim_source: str = "127.0.0.2",
    attacker_source: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
    starvation_streams: int = STARVATION_STREAMS,
    starvation_max_tokens: int = STARVATION_MAX_TOKENS,
) -> dict[str, object]:
    """`attack` (one of ATTACKS) from `attacker_source` while `victims` closed-loop clients from
    `victim_source` send small chat completions; both sides' outcomes and latencies. The
    starvation attack keeps `starvation_streams` streams of `starvation_max_tokens` open."""
    url = f"{router}/v1/chat/completions"
    attacker, victim = LoadResult(0, seconds), LoadResult(victims, seconds)
    deadline = time.monotonic() + seconds

    def client(source: str, n: int) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(local_address=source, limits=httpx.Limits(max_connections=n))
        asked = {**(headers or {}), "x-sglpd-timing": "1"}
        return httpx.AsyncClient(timeout=httpx.Timeout(600.0), transport=transport, headers=asked)

    async def attack_loop(c: httpx.AsyncClient, body: dict[str, object], until: float) -> None:
        while time.monotonic() < until:
            await _one(c, url, body, attacker)

    async def victim_loop(i: int, c: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < deadline:
            body = {"messages": [{"role": "user", "content": f"Victim {i}, {n}: say hi."}],
                    "max_tokens": victim_max_tokens, "stream": True}  # fmt: skip
            await _one(c, url, body, victim)
            n += 1

    bodies: list[dict[str, object]] = []
    if attack == "starvation":
        long = {"messages": [{"role": "user", "content": "Write a very long story."}],
                "max_tokens": starvation_max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
        bodies = [long] * starvation_streams
    elif attack == "head-of-line":
        bodies = [{"messages": [{"role": "user", "content": "x " * 30_000}], "max_tokens": 64, "stream": True}]
    elif attack != "none":
        raise ValueError(f"Unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}.")
    async with client(attacker_source, max(1, len(bodies))) as a, client(victim_source, victims) as v:
        # The attacker runs on until the victims are done, so that they never run alone.
        attacks = [asyncio.ensure_future(attack_loop(a, b, deadline)) for b in bodies]
        await asyncio.sleep(2.0)  # the attack takes hold first
        await asyncio.gather(*(victim_loop(i, v) for i in range(victims)))
        for task in attacks:
            task.cancel()
        await asyncio.gather(*attacks, return_exceptions=True)

    def p99(values: list[float]) -> float | None:
        lat = sorted(values)
        return round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None

    queued = p99(victim.queue_s)
    end_to_end = p99(victim.latencies_s.get("200", []))
    return {
        "attack": attack,
        "attack_size": {"streams": len(bodies), "max_tokens": bodies[0]["max_tokens"]} if bodies else None,
        "victims": victim.summary(),
        "attacker": attacker.summary(),
        "victim_p99_s": end_to_end,
        # What a victim saw end to end, engines' compute included: the bound that only engines
        # faster than a CPU reference engine can keep (`--end-to-end`).
        "victims_end_to_end_ok": end_to_end is not None and end_to_end < VICTIM_P99_BOUND_S,
        "victim_admission_wait_p99_s": queued,
        "victim_admission_wait_max_s": round(max(victim.queue_s), 3) if victim.queue_s else None,
        "victims_ok": queued is not None
        and queued < VICTIM_P99_BOUND_S
        and set(victim.outcomes) == {"200"}
        and len(victim.queue_s) == victim.outcomes["200"],
    }


def _gauges(url: str, headers: dict[str, str] | None) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in LEFTOVER_GAUGES:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def engine_leftovers(
    engines: dict[str, str], *, settle_s: float = 15.0, headers: dict[str, str] | None = None
) -> dict[str, dict[str, float]]:
    """Each engine's non-zero leftover gauges, once they are all 0 or `settle_s` has passed
    (aborted legs take a moment to reach the engines)."""
    deadline = time.monotonic() + settle_s
    while True:
        left = {role: {k: v for k, v in _gauges(url, headers).items() if v} for role, url in engines.items()}
        left = {role: g for role, g in left.items() if g}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", required=True, help="the router's base URL")
    ap.add_argument("--prefill", action="append", default=[], help="a prefill engine's base URL (repeatable)")
    ap.add_argument("--decode", action="append", default=[], help="a decode engine's base URL (repeatable)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--attack", action="append", choices=ATTACKS, help="run this attack instead (repeatable)")
    ap.add_argument("--victims", type=int, default=8, help="victim clients during an attack")
    ap.add_argument("--victim-max-tokens", type=int, default=4)
    ap.add_argument("--victim-source", default="127.0.0.2", help="the victims' source address")
    ap.add_argument(
        "--starvation-streams", type=int, default=STARVATION_STREAMS, help="the starvation attack's streams"
    )
    ap.add_argument("--starvation-max-tokens", type=int, default=STARVATION_MAX_TOKENS)
    ap.add_argument(
        "--end-to-end",
        action="store_true",
        help="the victims' end-to-end p99 must also stay under 1 s (engines as fast as a GPU's)",
    )
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.attack:
        return _main_attacks(args, argv)
    client_key = os.environ.get("SGLANG_PD_ROUTER_API_KEY")
    worker_key = os.environ.get("SGLANG_PD_WORKER_API_KEY")
    headers = {"authorization": f"Bearer {client_key}"} if client_key else None
    result = asyncio.run(
        run_load(args.router, clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens, headers=headers)
    )
    engines = {f"prefill{i}": u for i, u in enumerate(args.prefill)} | {
        f"decode{i}": u for i, u in enumerate(args.decode)
    }
    leftovers = engine_leftovers(engines, headers={"authorization": f"Bearer {worker_key}"} if worker_key else None)
    summary = result.summary()
    print(f"{'outcome':<12}{'requests':>10}")
    for key, n in summary["outcomes"].items():  # type: ignore[attr-defined]
        print(f"{key:<12}{n:>10}")
    print(f"latency by outcome (s): {summary['latency_s']}  429/503 without Retry-After: {result.retry_after_missing}")
    print(f"engines after the load: {leftovers or 'no rooms, pages or requests left'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([sys.executable, "-m", "benchmarks.bench_overload", *(argv or sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "result": summary,
            "engine_leftovers": leftovers,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if result.bad or result.retry_after_missing or leftovers else 0


def _main_attacks(args: argparse.Namespace, argv: list[str] | None) -> int:
    client_key = os.environ.get("SGLANG_PD_ROUTER_API_KEY")
    worker_key = os.environ.get("SGLANG_PD_WORKER_API_KEY")
    headers = {"authorization": f"Bearer {client_key}"} if client_key else None
    load_before = os.getloadavg()
    rows = []
    for attack in args.attack:
        row = asyncio.run(
            run_attack(
                args.router,
                attack,
                seconds=args.seconds,
                victims=args.victims,
                victim_max_tokens=args.victim_max_tokens,
                victim_source=args.victim_source,
                headers=headers,
                starvation_streams=args.starvation_streams,
                starvation_max_tokens=args.starvation_max_tokens,
            )
        )
        rows.append(row)
        v, a = row["victims"], row["attacker"]
        print(
            f"{attack}: victims {v['outcomes']} p99 {row['victim_p99_s']} s, admission wait p99 "  # type: ignore[index]
            f"{row['victim_admission_wait_p99_s']} s; attacker {a['outcomes']}"  # type: ignore[index]
        )
    engines = {f"prefill{i}": u for i, u in enumerate(args.prefill)} | {
        f"decode{i}": u for i, u in enumerate(args.decode)
    }
    leftovers = engine_leftovers(engines, headers={"authorization": f"Bearer {worker_key}"} if worker_key else None)
    print(f"engines after the attacks: {leftovers or 'no rooms, pages or requests left'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join([sys.executable, "-m", "benchmarks.bench_overload", *(argv or sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "results": rows,
            "engine_leftovers": leftovers,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    bound = ("victims_ok", "victims_end_to_end_ok") if args.end_to_end else ("victims_ok",)
    return 0 if all(r[k] for r in rows for k in bound) and not leftovers else 1


if __name__ == "__main__":
    raise SystemExit(main())
