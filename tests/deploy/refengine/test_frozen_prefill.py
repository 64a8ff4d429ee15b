"""A frozen prefill is ejected within 2 s by the router's default liveness probes, and a busy one
never is.

Real processes: a prefill and a decode reference engine and a router with its default health
settings. Under a load of streams, the router's view of the prefill is sampled every 50 ms: it
stays healthy however busy the prefill is (the control: the probes do not eject a worker for being
slow to generate). Then the prefill is SIGSTOPped, as a hung host or a stuck process would be, and
the router must take it out of routing within 2 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Proc, launcher

# serial: its latency bound holds on idle cores, so `make unit` runs it after the parallel part.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

EJECT_S = 2.0
LOAD_S = 6.0
STREAMS = 6


def _prefill_healthy(router: Proc, prefill: Proc) -> bool:
    workers = httpx.get(f"{router.url}/workers", timeout=5).json()
    return next(w for w in workers["prefill"] if w["url"] == prefill.url)["healthy"] is True


async def _load(url: str, seconds: float) -> int:
    """STREAMS streams back to back for `seconds`; returns how many completed."""
    done = 0
    stop = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < stop:
            body = {"text": f"Load {i}: " + "tell me about the sea. " * 20, "stream": True,
                    "sampling_params": {"max_new_tokens": 24}}  # fmt: skip
            async with client.stream("POST", f"{url}/generate", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
            done += r.status_code == 200
            i += STREAMS

    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        await asyncio.gather(*(worker(client, k) for k in range(STREAMS)))
    return done


def test_a_frozen_prefill_is_out_within_2_s_and_a_busy_one_stays(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        prefill, decode = lx.engine("prefill"), lx.engine("decode")
        router = lx.router(prefill, decode)  # the router's default health settings
        lx.wait()
        deadline = time.monotonic() + 30
        while not _prefill_healthy(router, prefill):
            assert time.monotonic() < deadline, "the prefill was never admitted"
            time.sleep(0.1)

        # Busy: sampled throughout a load that keeps the prefill computing.
        load = asyncio.new_event_loop()
        try:
            task = load.create_task(_load(router.url, LOAD_S))
            samples = []
            while not task.done():
                load.run_until_complete(asyncio.sleep(0.05))
                samples.append(_prefill_healthy(router, prefill))
            completed = task.result()
        finally:
            load.close()
        assert completed >= STREAMS, completed  # the load ran
        unhealthy = samples.count(False)
        assert samples and not unhealthy, f"a busy prefill was ejected ({unhealthy} of {len(samples)} samples)"

        # Frozen: out of routing within EJECT_S.
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            while _prefill_healthy(router, prefill):
                assert time.monotonic() - frozen_at < EJECT_S + 3, "the frozen prefill was never ejected"
                time.sleep(0.02)
            ejected_after = time.monotonic() - frozen_at
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        assert ejected_after <= EJECT_S, f"the frozen prefill was ejected after {ejected_after:.2f} s"
