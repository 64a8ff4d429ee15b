"""Faults: a corrupted page is caught (or changes the output); a decode engine killed mid-transfer."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Proc, greedy_reference, launcher

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

PROMPT = [random.Random(3).randrange(2, 258) for _ in range(100)]
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


async def _pd_generate(prefill: Proc, decode: Proc, room: int) -> tuple[httpx.Response, httpx.Response]:
    """What a PD router does: the same body, with bootstrap fields, to both engines at once."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": PARAMS,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    async with httpx.AsyncClient(timeout=60) as c:
        p, d = await asyncio.gather(
            c.post(f"{prefill.url}/generate", json=body), c.post(f"{decode.url}/generate", json=body)
        )
    return p, d


def test_corrupted_page_is_detected_or_changes_output(tmp_path: Path, reference_model) -> None:  # type: ignore[no-untyped-def]
    expected = greedy_reference(reference_model, PROMPT, PARAMS["max_new_tokens"])
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", env={"SGLANG_PD_REFENGINE_TEST_CORRUPT_PAGE": "1"})
        checking = lx.engine("decode", name="decode-verify")
        trusting = lx.engine("decode", env={"SGLANG_PD_REFENGINE_VERIFY_KV": "0"}, name="decode-noverify")
        lx.wait()
        # With the check on (the default) the decode engine refuses the corrupted KV: a clean 5xx.
        _, d = asyncio.run(_pd_generate(prefill, checking, room=1))
        assert d.status_code == 502
        assert "KV integrity check failed" in d.json()["error"]["message"]
        assert checking.metric("sglang_pd_refengine_kv_pages_used") == 0
        # With the check off, the corrupted page reaches the model and the tokens differ.
        p, d = asyncio.run(_pd_generate(prefill, trusting, room=2))
        assert p.status_code == 200 and d.status_code == 200, d.text
        assert d.json()["output_ids"] != expected


def test_decode_killed_mid_transfer(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        # spread the prefill's page writes over 6 s so that the kill lands inside the transfer
        prefill = lx.engine("prefill", env={"SGLANG_PD_REFENGINE_TEST_SLOW_TRANSFER_S": "6"})
        decode = lx.engine("decode")
        lx.wait(prefill, decode)
        router = lx.router(prefill, decode)
        lx.wait(router)
        reply: dict[str, httpx.Response] = {}

        def client() -> None:
            body = {"text": "z" * 400, "sampling_params": PARAMS}
            reply["r"] = httpx.post(f"{router.url}/generate", json=body, timeout=30)

        t = threading.Thread(target=client)
        t.start()
        deadline = time.monotonic() + 20
        while prefill.metric("sglang_pd_refengine_kv_transfers_in_flight") < 1:
            assert time.monotonic() < deadline, "the transfer never started"
            time.sleep(0.05)
        time.sleep(0.5)
        decode.kill()
        killed = time.monotonic()
        while not prefill.metric("sglang_pd_kv_failures_total"):
            assert time.monotonic() - killed < 2, "the prefill did not report the failed transfer within 2 s"
            time.sleep(0.05)
        reported = time.monotonic() - killed
        while prefill.metric("sglang_pd_refengine_kv_pages_used"):
            assert time.monotonic() - killed < 2, "the prefill did not free its pages within 2 s"
            time.sleep(0.05)
        t.join(15)
        assert not t.is_alive(), "the client hung"
        r = reply["r"]
        assert 500 <= r.status_code < 600
        assert r.json()  # a JSON error body, not a torn stream
        log = prefill.log.read_text()
        assert '"event":"kv_transfer_failed"' in log and "PeerUnreachable" in log
        assert reported < 2
        # the prefill engine stays healthy and serves on its own
        assert httpx.get(f"{prefill.url}/health_generate", timeout=30).status_code == 200
