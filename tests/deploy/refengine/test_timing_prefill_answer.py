"""The TTFT breakdown when the decode's first token reaches the router before the prefill's answer.

In sglang both follow the same KV-transfer event, in either order; the reference engine's
SGLANG_PD_REFENGINE_TEST_PREFILL_ANSWER_DELAY_S makes the prefill answer last. A request that asked
for the breakdown (`x-sglpd-timing: 1`) waits for that answer before its first bytes leave, so that
a slow KV transfer is blamed on `transfer` and not folded into `prefill`; a request that did not ask
is not held.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.router.metrics import TTFT_PARTS

from .conftest import launcher

pytestmark = pytest.mark.slow

TRANSFER_S = 1.0
ANSWER_DELAY_S = 0.6
HOOKS = {
    "SGLANG_PD_REFENGINE_TEST_SLOW_TRANSFER_S": str(TRANSFER_S),
    "SGLANG_PD_REFENGINE_TEST_PREFILL_ANSWER_DELAY_S": str(ANSWER_DELAY_S),
}


def _first_chunk(client: httpx.Client, url: str, i: int, timed: bool) -> tuple[float, dict[str, float]]:
    body = {"text": f"Prompt {i}: where did the time go?", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    headers = {"x-sglpd-timing": "1"} if timed else {}
    client.get(f"{url}/health")  # the connection is open before the clock starts
    started = time.perf_counter()
    with client.stream("POST", f"{url}/generate", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_raw()
        next(chunks)
        ttft = time.perf_counter() - started
        for _ in chunks:
            pass
    parts = {}
    for entry in r.headers.get("server-timing", "").split(","):
        name, _, dur = entry.strip().partition(";dur=")
        if dur:
            parts[name] = float(dur) / 1000
    return ttft, parts


def test_a_slow_transfer_is_blamed_on_transfer_when_the_prefill_answers_last(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", env=HOOKS)
        decode = lx.engine("decode")
        router = lx.router(prefill, decode)
        lx.wait()
        with httpx.Client(timeout=60) as client:
            timed = [_first_chunk(client, router.url, i, timed=True) for i in range(3)]
            untimed = [_first_chunk(client, router.url, 10 + i, timed=False) for i in range(3)]
    for ttft, parts in timed:
        assert max(TTFT_PARTS, key=lambda p: parts[p]) == "transfer", parts
        assert parts["transfer"] > 0.8 * TRANSFER_S and parts["prefill"] < 0.5 * TRANSFER_S, parts
        assert abs(sum(parts[p] for p in TTFT_PARTS) - ttft) / ttft < 0.05, (ttft, parts)
    # Only the requests that asked waited for the prefill's answer: the others' first bytes left
    # about ANSWER_DELAY_S sooner, without a breakdown header.
    assert all(not parts for _, parts in untimed)
    fastest_timed, slowest_untimed = min(t for t, _ in timed), max(t for t, _ in untimed)
    assert fastest_timed - slowest_untimed > 0.5 * ANSWER_DELAY_S, (timed, untimed)
