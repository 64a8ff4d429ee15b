"""Migration's acceptance run with real processes: 64 greedy streams through 1 prefill and 2 decode
reference engines (fp32), one decode SIGKILLed at a random point, three times (the killed decode
is started again on its port between rounds).

Each round: every stream completes, without an error event, token-identical to an uninterrupted
run, none hangs; afterwards the engines hold no KV page, bootstrap room, running or waiting
request or KV transfer, and the router no active request and no in-flight or admitted request on
any worker (the same gauges, read while the streams run, are above 0: the check can fail). The
control: a router with `--migration-limit 0`, the same kind of kill, ends streams with the error
event. The latency the moves added (p50/p99, moved streams against their uninterrupted run) is
printed.

The kill points come from random.Random(MIGRATION_KILL_RANDOM) (default 1206): a delay of 10 % to
70 % of the uninterrupted run's length after the streams start.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import TINY_MODEL, Launcher, Proc, launcher
from .test_migration import (
    MOONCAKE_PORTS,
    StreamResult,
    _all_admitted,
    _decoding,
    _moved_ids,
    _pct,
    _router,
    _stream,
)

# Real processes, 64 streams three times: about a minute on 2 idle cores.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

STREAMS = 64
MAX_NEW = 32  # tokens per stream: three rounds of 64 streams stay near two minutes on 2 cores
ROUNDS = 3
HANG_S = 120.0
ENGINE_GAUGES = (
    "sglang_pd_refengine_kv_pages_used",
    "sglang_pd_refengine_bootstrap_rooms",
    "sglang_pd_refengine_running_requests",
    "sglang_pd_refengine_waiting_requests",
    "sglang_pd_refengine_kv_transfers_in_flight",
)


def _held(engines: list[Proc], router: Proc) -> dict[str, float]:
    """What the live engines and the router hold now."""
    out = {name: 0.0 for name in ENGINE_GAUGES}
    for e in engines:
        if e.proc.poll() is None:
            with_metrics = e.metrics()
            for name in ENGINE_GAUGES:
                out[name] += sum(v for k, v in with_metrics.items() if k.split("{")[0] == name)
    out["router_active_requests"] = router.metric("sglang_pd_router_active_requests")
    workers = httpx.get(f"{router.url}/workers", timeout=5).json()
    for key in ("in_flight", "admitted", "admitted_tokens"):
        out["router_worker_" + key] = float(
            sum(
                w.get(key) or (w.get("capacity") or {}).get(key) or 0 for r in ("prefill", "decode") for w in workers[r]
            )
        )
    return out


async def _run(
    url: str, kill: Proc | None, delay: float, sample: tuple[list[Proc], Proc] | None, mid_streams: int = 0
) -> tuple[list[StreamResult], float, dict[str, float]]:
    """STREAMS concurrent streams; `kill` SIGKILLed `delay` s after they start, or with `mid_streams`
    once that many streams are past their first token and far from their last. Returns the results,
    the run's length, and the most each gauge held while it ran (sampled when `sample` is given)."""
    progress = [0] * STREAMS
    peak: dict[str, float] = {}
    limits = httpx.Limits(max_connections=STREAMS + 4)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits) as client:
        tasks = [asyncio.ensure_future(_stream(client, url, i, progress, MAX_NEW)) for i in range(STREAMS)]
        if kill is not None and mid_streams:
            # Streams in mid-answer, and the victim itself decoding some: under load the streams in
            # mid-answer may all sit on the other decode while the victim's still wait for their KV.
            while sum(0 < p < MAX_NEW // 2 for p in progress) < mid_streams or not await _decoding(kill):
                assert not all(t.done() for t in tasks), "the streams ended before the kill"
                await asyncio.sleep(0.01)
            kill.kill()
        elif kill is not None:
            await asyncio.sleep(delay)
            kill.kill()
        if sample is not None:
            while not all(t.done() for t in tasks):
                held = await asyncio.to_thread(_held, *sample)
                peak = {k: max(v, peak.get(k, 0.0)) for k, v in held.items()}
                await asyncio.sleep(0.3)
        _, pending = await asyncio.wait(tasks, timeout=HANG_S)
        for t in pending:
            t.cancel()
        assert not pending, f"{len(pending)} stream(s) hung"
        return [t.result() for t in tasks], time.perf_counter() - started, peak


def _settled(engines: list[Proc], router: Proc, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        held = _held(engines, router)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.3)


def _restart(lx: Launcher, dead: Proc) -> Proc:
    """A new decode engine on the killed one's port (the URL the router knows), as Launcher starts one."""
    port = dead.url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "engine", "--role", "decode", "--port", port]
    argv += ["--model", TINY_MODEL, "--threads", "1", "--log-level", "info"]
    log = lx.tmp / f"{dead.name}-again.log"
    proc = subprocess.Popen(
        argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, **MOONCAKE_PORTS},
        start_new_session=True,
    )  # fmt: skip
    again = Proc(f"{dead.name}-again", proc, dead.url, log)
    lx.procs.append(again)
    return again


def test_64_streams_decode_killed_at_random_points(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("MIGRATION_KILL_RANDOM", "1206")))
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", env=MOONCAKE_PORTS)
        decodes = [lx.engine("decode", env=MOONCAKE_PORTS), lx.engine("decode", env=MOONCAKE_PORTS)]
        router = _router(lx, prefill, decodes, limit=1)
        lx.wait()
        _all_admitted(router)
        baseline, length, _ = asyncio.run(_run(router.url, None, 0.0, None))
        assert all(r.done and not r.error and len(r.ids) == MAX_NEW for r in baseline), baseline

        added: list[float] = []
        moved_total = 0
        report = []
        for k in range(ROUNDS):
            victim = decodes[k % 2]
            delay = rng.uniform(0.1, 0.7) * length
            before = _moved_ids(router)
            engines = [prefill, *decodes]
            results, _, peak = asyncio.run(_run(router.url, victim, delay, (engines, router)))
            moved = _moved_ids(router) - before
            errors = [i for i, r in enumerate(results) if r.error or not r.done]
            assert not errors, f"round {k}: streams {errors} ended with an error: {[results[i].error for i in errors]}"
            differ = [i for i in range(STREAMS) if results[i].ids != baseline[i].ids]
            assert not differ, f"round {k}: streams {differ} differ from the uninterrupted run"
            held = _settled(engines, router)
            assert not any(held.values()), f"round {k}: state left behind: {held}"
            # The gauges are read for real: the pages and the router's admissions were above 0.
            assert peak["sglang_pd_refengine_kv_pages_used"] > 0 and peak["router_worker_admitted"] > 0, peak
            for i, r in enumerate(results):
                if f"mig-{i}" in moved:
                    added.append(r.seconds - baseline[i].seconds)
            moved_total += len(moved)
            report.append(f"kill at {delay:.2f} s: {len(moved)} moved")
            decodes[k % 2] = _restart(lx, victim)
            lx.wait(decodes[k % 2])
            _all_admitted(router)
        assert moved_total, "no stream was on a killed decode: the rounds killed nothing that mattered"

        # The control: the same kill with migration off breaks streams. It waits for streams in
        # mid-answer and for the victim to be decoding: a kill timed by the clock alone may come while
        # every stream is still before its first token, and those the router retries even without migration.
        control = _router(lx, prefill, decodes, limit=0)
        lx.wait(control)
        _all_admitted(control)
        broken, _, _ = asyncio.run(_run(control.url, decodes[0], 0.0, None, mid_streams=STREAMS // 4))
    ended_in_error = [r for r in broken if r.error]
    assert ended_in_error, "limit 0: the kill should have ended the killed decode's streams with the error event"
    print(
        f"\nacceptance: {STREAMS} streams x {ROUNDS} kills ({'; '.join(report)}); uninterrupted run "
        f"{length:.2f} s; added latency of the {len(added)} moved streams p50/p99 "
        f"{_pct(added, 0.5):.3f}/{_pct(added, 0.99):.3f} s; control: {len(ended_in_error)} broken"
    )


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
