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

Prints a table and writes JSON with the command, machine and date. The exit status is 1 when a
request ended other than with 200, 429 or 503, when a 200 stream was cut, or when the engines kept
rooms, pages or requests.
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


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object], result: LoadResult) -> None:
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as resp:
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
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
