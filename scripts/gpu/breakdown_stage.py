"""Where a request's TTFT goes, on real sglang: the router's parts add up to what the client saw,
and an injected delay is blamed on its own part.

The stack's processes carry `faults/pd_check_delay.py` (through PD_CHECK_DELAY_DIR), which makes the
prefill's forward pass or its KV send wait while a flag file exists. With LOAD streams kept in
flight by a process of their own, each case in turn:

- `none`: no flag;
- `prefill`: `prefill.on` holds DELAY_S: every prefill batch waits that long before it runs;
- `transfer`: `transfer.on` holds DELAY_S: every KV send of a chunk waits that long.

In each, TIMED streamed `/generate` requests ask for the breakdown (`x-sglpd-timing: 1`, answered
in a `Server-Timing` header: deploy/router/timing.py). The client times each from the request
sent to its first body bytes, on a connection opened before the clock starts.

What must hold (pure functions below, shown failing in `tests/scripts/test_breakdown_stage.py`):
- `sums`: every timed request's parts add up to its client TTFT within 5 %, and the router's own
  part (what is left once the others are placed) is not negative;
- `blame`: under `prefill` the prefill part, and under `transfer` the transfer part, is the
  largest of every request and at least 0.8 × DELAY_S;
- `control`: the blame verdict must fail where its delay was not: on the `none` timings for both
  parts, and on each delayed case's timings for the other part. A breakdown that put every delay in
  one part, or blamed whatever was slow, fails here.

The router learns where the prefill's forward pass ended from the prefill's answer
(`meta_info.prefill_finished_time`). A decode whose first token reaches the router before that
answer leaves the transfer inside `prefill` (timing.py): `blame_transfer` then fails, which is a
finding about the breakdown on real sglang, not a fault of the check.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from sglang_pd.deploy.router.metrics import TTFT_PARTS

CASES = ("none", "prefill", "transfer")
DELAY_S = 1.0
TIMED = 8
LOAD = 4
#: How far the parts' sum may be from the client's TTFT, and the share of the delay its part must show.
SUM_TOLERANCE = 0.05
BLAME_SHARE = 0.8

Timing = tuple[float, dict[str, float]]


def parse_server_timing(header: str) -> dict[str, float]:
    """`Server-Timing: queue;dur=0.1, prefill;dur=12.5, ...` in seconds, by name."""
    parts: dict[str, float] = {}
    for entry in header.split(","):
        name, _, dur = entry.strip().partition(";dur=")
        if name and dur:
            parts[name] = float(dur) / 1000
    return parts


def shown(parts: dict[str, float], leave_out: str = "") -> float:
    """The TTFT the parts add up to, without `leave_out`."""
    return sum(parts.get(p, 0.0) for p in TTFT_PARTS if p != leave_out)


def blamed(parts: dict[str, float]) -> str:
    """The part the breakdown points at: the largest."""
    return max(TTFT_PARTS, key=lambda p: parts.get(p, 0.0))


def sums_verdict(case: str, timings: Sequence[Timing]) -> str | None:
    if not timings:
        return f"{case}: no timed request"
    for ttft, parts in timings:
        missing = [p for p in TTFT_PARTS if p not in parts]
        if missing:
            return f"{case}: the breakdown lacks {', '.join(missing)}: {parts}"
        off = abs(shown(parts) - ttft) / ttft
        if off >= SUM_TOLERANCE:
            return f"{case}: the parts add up to {shown(parts):.4f} s against the client's {ttft:.4f} s ({off:.1%} off)"
        if parts["router"] < 0:
            return f"{case}: the router's own part is negative: the other parts overlap ({parts})"
    return None


def blame_verdict(case: str, timings: Sequence[Timing], delay_s: float = DELAY_S) -> str | None:
    if case == "none":
        return None
    for _, parts in timings:
        if blamed(parts) != case or parts[case] < BLAME_SHARE * delay_s:
            return f"{case} delayed by {delay_s:g} s, but the breakdown blames {blamed(parts)}: {parts}"
    return None


def control_verdict(cases: dict[str, list[Timing]], delay_s: float = DELAY_S) -> str | None:
    """The blame verdict must fail on every case whose delay was elsewhere (or absent)."""
    for part in ("prefill", "transfer"):
        for case, timings in cases.items():
            if case != part and timings and blame_verdict(part, timings, delay_s) is None:
                return f"the {case} run's timings pass as a slowed {part}: the blame verdict cannot tell them apart"
    return None


def table(cases: dict[str, list[Timing]]) -> list[dict[str, Any]]:
    """One row per case: the medians of the client's TTFT and of each part, in ms."""
    rows = []
    for case, timings in cases.items():
        if not timings:
            continue
        row: dict[str, Any] = {"case": case, "requests": len(timings)}
        row["client_ttft_ms"] = round(statistics.median(t for t, _ in timings) * 1000, 1)
        for p in TTFT_PARTS:
            row[f"{p}_ms"] = round(statistics.median(parts.get(p, 0.0) for _, parts in timings) * 1000, 1)
        row["parts_sum_ms"] = round(statistics.median(shown(parts) for _, parts in timings) * 1000, 1)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Requests


def timed_stream(client: httpx.Client, url: str, case: str, i: int) -> Timing:
    # A prompt of its own per case: a cached prefix would make sglang send the KV in two parts
    # (and wait the transfer delay twice).
    body = {
        "text": f"Timed prompt {i} of the {case} case: where did the time go?",
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    client.get(f"{url}/health")  # the connection is open before the clock starts
    started = time.perf_counter()
    with client.stream("POST", f"{url}/generate", json=body, headers={"x-sglpd-timing": "1"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"timed request {i}: HTTP {r.status_code}: {r.read()[:300]!r}")
        chunks = r.iter_raw()
        next(chunks)
        ttft = time.perf_counter() - started
        for _ in chunks:
            pass
    return ttft, parse_server_timing(r.headers.get("server-timing", ""))


async def _load(url: str, n: int, stop: Path) -> int:
    done = 0

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        i = k
        while not stop.exists():
            body = {
                "text": f"Background prompt {i}: tell me about the sea.",
                "stream": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0},
            }
            async with client.stream("POST", f"{url}/generate", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
            done += r.status_code == 200
            i += n

    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        await asyncio.gather(*(worker(client, k) for k in range(n)))
    return done


def measure(url: str, delay_dir: Path | None, out: Path, cases: Sequence[str] = CASES) -> dict[str, Any]:
    """Each case's timed requests under load; `delay_dir`: the stack's PD_CHECK_DELAY_DIR (needed for
    any case but `none`)."""
    result: dict[str, Any] = {"delay_s": DELAY_S, "load_streams": LOAD, "cases": {}}
    for case in cases:
        if case != "none" and delay_dir is None:
            raise ValueError(f"case {case!r} needs the stack's delay folder (PD_CHECK_DELAY_DIR)")
        stop = out / f"load-{case}.stop"
        stop.unlink(missing_ok=True)
        load = subprocess.Popen(
            [sys.executable, __file__, "--load", url, str(LOAD), str(stop)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        flag = delay_dir / f"{case}.on" if delay_dir is not None and case != "none" else None
        try:
            if flag is not None:
                flag.write_text(f"{DELAY_S}\n")
            time.sleep(2 + (3 * DELAY_S if flag else 0))  # the load is in flight
            timings: list[Timing] = []
            with httpx.Client(timeout=60, trust_env=False) as client:
                for i in range(TIMED):
                    timings.append(timed_stream(client, url, case, i))
        finally:
            if flag is not None:
                flag.unlink(missing_ok=True)
            stop.touch()
            try:
                completed, _ = load.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                load.kill()
                completed, _ = load.communicate()
        result["cases"][case] = {
            "timings": [{"client_ttft_s": t, "parts_s": p} for t, p in timings],
            "load_completed": int(completed.split()[-1]) if completed.split() else None,
        }
    return result


def by_case(result: dict[str, Any]) -> dict[str, list[Timing]]:
    """`measure`'s timings as (client TTFT, parts) by case."""
    return {c: [(t["client_ttft_s"], t["parts_s"]) for t in v["timings"]] for c, v in result["cases"].items()}


def verdicts(result: dict[str, Any]) -> dict[str, str | None]:
    """Every requirement over `measure`'s result: None where it holds."""
    cases = by_case(result)
    out: dict[str, str | None] = {}
    for case, timings in cases.items():
        out[f"sums_{case}"] = sums_verdict(case, timings)
        if case != "none":
            out[f"blame_{case}"] = blame_verdict(case, timings, result["delay_s"])
    if len(cases) > 1:
        out["control"] = control_verdict(cases, result["delay_s"])
    return out


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--load":
    # The load process: LOAD streams until the stop file appears; prints how many completed.
    print(asyncio.run(_load(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))), flush=True)
