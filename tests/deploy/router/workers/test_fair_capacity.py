"""No client can starve another at the engines' capacity (workers/capacity.py, workers/fairness.py):
a prompt that cannot fit is refused at once, a request reserves what it likely uses rather than
its whole max_tokens, a request that fits passes a queue head that does not, and a client that
holds its share of the decodes waits behind another client's request. A router on loopback in
front of test workers that report a small capacity."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.workers.capacity import CapacityGate, Demand
from tests.support.polling import wait_until

from ..conftest import Cluster

CHAT = "/v1/chat/completions"
KEY_A, KEY_B = "sk-fair-a", "sk-fair-b"
_open: list[object] = []


def _chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


async def _hold(stack: contextlib.AsyncExitStack, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    """Open a stream and read its first bytes: it is admitted and runs until `stack` closes it."""
    resp = await stack.enter_async_context(client.stream("POST", url + CHAT, json={**body, "stream": True}))
    assert resp.status_code == 200, await resp.aread()
    chunks = resp.aiter_raw()
    await anext(chunks)
    _open.append(chunks)  # a reader dropped unfinished closes its stream when collected


def _client_from(address: str) -> httpx.AsyncClient:
    """A client connecting from `address`: loopback answers on all of 127.0.0.0/8, so two clients
    on one machine are two addresses to the router."""
    return httpx.AsyncClient(timeout=30, transport=httpx.AsyncHTTPTransport(local_address=address))


def _capacity(url: str) -> dict[str, Any]:
    (decode,) = httpx.get(url + "/workers").json()["decode"]
    return dict(decode["capacity"])


def test_a_prompt_that_cannot_fit_is_refused_at_once(cluster_factory: Callable[..., Cluster]) -> None:
    # The pools hold 2048 tokens, the context 4096 (the test workers' /server_info).
    cluster = cluster_factory(1, 1, max_total_num_tokens=2048)
    with cluster.serve(cluster.config(queue_timeout_s=30)) as running:
        cases = [
            (CHAT, _chat("word " * 4800, 8), 413, "2048"),  # 24 KB: at least 4000 tokens, over the pool
            (CHAT, _chat("word " * 12000, 8), 400, "4096"),  # 60 KB: over the context
            ("/generate", {"input_ids": [7] * 5000, "sampling_params": {"max_new_tokens": 8}}, 400, "4096"),
        ]
        for path, body, status, limit in cases:
            tic = time.monotonic()
            resp = httpx.post(running.url + path, json=body, timeout=40)
            assert time.monotonic() - tic < 2.0, "refused at once, not after waiting for room"
            assert resp.status_code == status, resp.text
            assert limit in resp.json()["error"]["message"], resp.text
        assert cluster.decodes[0].requests == [], "no engine saw a refused prompt"
        # A prompt that fits is served.
        assert httpx.post(running.url + CHAT, json=_chat("word " * 400, 8), timeout=10).status_code == 200


def test_long_max_tokens_do_not_reserve_the_whole_pool(cluster_factory: Callable[..., Cluster]) -> None:
    # sglang's numbers: a decode pool of 11648 tokens, three streams asking for 3860 tokens each.
    cluster = cluster_factory(1, 1, token_delay=0.05, max_total_num_tokens=11648)
    with cluster.serve(cluster.config(queue_timeout_s=2.0)) as running:

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client, contextlib.AsyncExitStack() as stack:
                for _ in range(3):
                    await _hold(stack, client, running.url, _chat("tell me a story", 3860))
                assert _capacity(running.url)["admitted_tokens"] <= 11648 // 2
                small = [client.post(running.url + CHAT, json=_chat("hi", 100)) for _ in range(4)]
                return [r.status_code for r in await asyncio.gather(*small)]

        assert asyncio.run(scenario()) == [200] * 4
        # The held streams' reservations go once the router has seen their clients leave.
        wait_until(lambda: _capacity(running.url)["admitted_tokens"] == 0)


def test_a_request_that_fits_passes_a_queue_head_that_does_not(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.05, max_total_num_tokens=4096)
    with cluster.serve(cluster.config(queue_timeout_s=3.0)) as running:

        async def scenario() -> tuple[float, int, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                async with contextlib.AsyncExitStack() as stack:
                    for _ in range(3):  # 3 × 401 tokens reserved
                        await _hold(stack, client, running.url, _chat("tell me a story", 400))
                    # About 3000 prompt tokens: it fits an empty pool, not this one.
                    head = asyncio.ensure_future(client.post(running.url + CHAT, json=_chat("word " * 2400, 16)))
                    await asyncio.sleep(0.3)
                    assert not head.done() and running.app.proxy.gate.waiting == 1, _capacity(running.url)
                    tic = time.monotonic()
                    small = await client.post(running.url + CHAT, json=_chat("hi", 8))
                    passed_in = time.monotonic() - tic
                    assert not head.done()
                # The streams are closed: the head fits now.
                return passed_in, small.status_code, (await head).status_code

        passed_in, small_status, head_status = asyncio.run(scenario())
        assert small_status == 200 and passed_in < 1.5, (small_status, passed_in)
        assert head_status == 200


async def _until_waiting(gate: CapacityGate, n: int, timeout_s: float = 20) -> None:
    """Until `n` requests wait at the gate (a fixed sleep is too short on a loaded host)."""
    deadline = time.monotonic() + timeout_s
    while gate.waiting < n:
        assert time.monotonic() < deadline, f"{gate.waiting} waiting after {timeout_s} s, expected {n}"
        await asyncio.sleep(0.01)
    assert gate.waiting == n, gate.waiting


@pytest.mark.parametrize("identity", ["api key", "address"])
def test_a_client_holding_its_share_waits_behind_another_client(
    cluster_factory: Callable[..., Cluster], identity: str
) -> None:
    # A decode that runs 4 requests; client A holds all 4 and queues a fifth, then B asks for one.
    # Without fairness the freed slot goes to A's fifth, the queue's head, and B waits 3 s.
    cluster = cluster_factory(1, 1, token_delay=0.05, max_running_requests=4)
    keys = (KEY_A, KEY_B) if identity == "api key" else ()
    with cluster.serve(cluster.config(queue_timeout_s=3.0, api_keys=keys)) as running:

        def client(key: str, address: str) -> httpx.AsyncClient:
            if identity == "api key":
                return httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {key}"})
            return _client_from(address)

        async def scenario() -> tuple[int, float, bool, int]:
            async with client(KEY_A, "127.0.0.1") as a, client(KEY_B, "127.0.0.2") as b:
                async with contextlib.AsyncExitStack() as a_streams:
                    closers = []
                    for _ in range(4):
                        inner = contextlib.AsyncExitStack()
                        await _hold(inner, a, running.url, _chat("tell me a story", 400))
                        closers.append(inner)
                        a_streams.push_async_callback(inner.aclose)
                    # A's fifth runs 3 s once admitted: if it took the freed slot, B would wait that long.
                    a_fifth = asyncio.ensure_future(a.post(running.url + CHAT, json=_chat("hi", 60)))
                    await _until_waiting(running.app.proxy.gate, 1)  # A's fifth queues first
                    b_first = asyncio.ensure_future(b.post(running.url + CHAT, json=_chat("hi", 8)))
                    await _until_waiting(running.app.proxy.gate, 2)
                    tic = time.monotonic()
                    await closers[0].aclose()  # one of A's streams ends: its slot goes to B
                    b_status = (await b_first).status_code
                    b_waited = time.monotonic() - tic
                    a_still_waits = not a_fifth.done()
                return b_status, b_waited, a_still_waits, (await a_fifth).status_code

        b_status, b_waited, a_still_waits, a_status = asyncio.run(scenario())
        assert b_status == 200 and b_waited < 1.5, (b_status, b_waited)
        assert a_still_waits, "A's queued request took the freed slot ahead of B"
        assert a_status == 200, "A is served once its streams end"


async def _until_admitted(client: httpx.AsyncClient, url: str, n: int, timeout_s: float = 20) -> None:
    """Until the router's decode has `n` requests admitted."""
    deadline = time.monotonic() + timeout_s
    while (admitted := (await client.get(url + "/workers")).json()["decode"][0]["capacity"]["admitted"]) < n:
        assert time.monotonic() < deadline, f"{admitted} admitted after {timeout_s} s, expected {n}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("reserve", [0.25, 0.0], ids=["reserve", "control-no-reserve"])
def test_a_client_alone_leaves_the_reserve_to_the_next_client(
    cluster_factory: Callable[..., Cluster], reserve: float
) -> None:
    # A decode that runs 4 requests; client A, alone, opens 3 long streams and asks for a fourth
    # slot, then B arrives. With a quarter in reserve, A may hold 3: its fourth waits and B is
    # served at once, and A's fourth is refused when the queue timeout passes, naming the reserve.
    # The control, no reserve: A takes the fourth slot and B waits out the queue timeout (429).
    cluster = cluster_factory(1, 1, token_delay=0.05, max_running_requests=4)
    config = cluster.config(queue_timeout_s=3.0, client_reserve=reserve)
    with cluster.serve(config) as running:

        async def scenario() -> tuple[httpx.Response, float, httpx.Response]:
            async with (
                _client_from("127.0.0.1") as a,
                _client_from("127.0.0.2") as b,
                contextlib.AsyncExitStack() as streams,
            ):
                for _ in range(3):
                    await _hold(streams, a, running.url, _chat("tell me a story", 400))  # 20 s each
                # 5 s once admitted: longer than B's queue timeout.
                a_fourth = asyncio.ensure_future(a.post(running.url + CHAT, json=_chat("hi", 100)))
                if reserve:
                    await _until_waiting(running.app.proxy.gate, 1)  # held back, though alone
                    # Past the passing limit (a quarter of the queue timeout), a head waiter held
                    # back for its share still lets a newcomer try at once.
                    await asyncio.sleep(1.0)
                    assert not running.app.proxy.gate._head_is_old(), "A's held-back fourth holds B back"
                else:
                    await _until_admitted(b, running.url, 4)
                tic = time.monotonic()
                b_first = await b.post(running.url + CHAT, json=_chat("hi", 8))
                return b_first, time.monotonic() - tic, await a_fourth

        b_first, b_waited, a_fourth = asyncio.run(scenario())
        if reserve:
            assert b_first.status_code == 200 and b_waited < 1.5, (b_first.status_code, b_waited)
            assert a_fourth.status_code == 429, a_fourth.text
            error = a_fourth.json()["error"]
            assert error["code"] == "capacity_client_reserve", error
            assert "held 3 of the decodes' 4 request slots" in error["message"], error
            assert "--client-reserve 0.25" in error["message"], error
        else:
            assert a_fourth.status_code == 200, a_fourth.text
            assert b_first.status_code == 429 and b_waited >= 2.5, (b_first.status_code, b_waited)
            assert b_first.json()["error"]["code"] == "capacity_queue_timeout", b_first.text


@pytest.mark.parametrize("reserve", [0.25, 0.0], ids=["reserve", "control-no-reserve"])
def test_a_batch_cannot_take_the_reserve_and_held_back_requests_do_not_fill_the_queue_for_others(
    cluster_factory: Callable[..., Cluster], reserve: float
) -> None:
    # A decode that runs 4 requests and a router queue of one. A holds 2 streams and sends a
    # batch of 2 prompts: with a quarter in reserve that would make 4 of 4, so the batch waits,
    # and fills the queue; B, arriving next, still gets the slot the reserve kept. The control, no
    # reserve: A's batch takes the last two slots and B waits out the queue timeout.
    cluster = cluster_factory(1, 1, token_delay=0.05, max_running_requests=4)
    config = cluster.config(queue_timeout_s=3.0, max_queued_requests=1, client_reserve=reserve)
    with cluster.serve(config) as running:

        async def scenario() -> tuple[httpx.Response, float, httpx.Response]:
            async with (
                _client_from("127.0.0.1") as a,
                _client_from("127.0.0.2") as b,
                contextlib.AsyncExitStack() as streams,
            ):
                for _ in range(2):
                    await _hold(streams, a, running.url, _chat("tell me a story", 400))
                batch = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 100}}  # 5 s each
                a_batch = asyncio.ensure_future(a.post(running.url + "/generate", json=batch))
                if reserve:
                    await _until_waiting(running.app.proxy.gate, 1)  # held back: the queue is full
                else:
                    await _until_admitted(b, running.url, 4)
                tic = time.monotonic()
                b_first = await b.post(running.url + CHAT, json=_chat("hi", 8))
                return b_first, time.monotonic() - tic, await a_batch

        b_first, b_waited, a_batch = asyncio.run(scenario())
        if reserve:
            assert b_first.status_code == 200 and b_waited < 1.5, (b_first.status_code, b_waited, b_first.text)
            assert a_batch.status_code == 429, a_batch.text
            error = a_batch.json()["error"]
            assert error["code"] == "capacity_client_reserve", error
            assert "held 2 of the decodes' 4 request slots" in error["message"], error
        else:
            assert a_batch.status_code == 200, a_batch.text
            assert b_first.status_code == 429 and b_waited >= 2.5, (b_first.status_code, b_waited)


def test_the_reserve_bounds_slots_and_tokens_rounds_up_and_lets_a_client_holding_nothing_run() -> None:
    def demand(slots: int = 1, prompt: int = 10) -> Demand:
        return Demand(slots, prompt, 10, slots, client="a")

    gate = CapacityGate(max_waiting=8, timeout_s=3.0, reserve=0.25)
    into = gate._into_reserve
    assert into(demand(slots=8), 4, 4096) is None  # holding nothing: one request runs, however large
    gate.ledger.add("a", 2, 100)
    assert into(demand(), 4, 4096) is None  # 3 of 4 slots: all but the reserve
    assert into(demand(slots=2), 4, 4096) == "request slots"  # a batch counts each of its prompts
    assert into(demand(prompt=3000), 64, 4096) == "KV tokens"  # 100 + 3,010 of 4,096, 1,024 kept
    assert into(demand(), 0, 0) is None  # no capacity reported yet: nothing to keep
    thirty = CapacityGate(max_waiting=8, timeout_s=3.0, reserve=0.3)
    thirty.ledger.add("a", 62, 0)
    assert thirty._into_reserve(demand(), 90, 0) is None  # 0.3 of 90 keeps 27, not 28
    assert thirty._into_reserve(demand(slots=2), 90, 0) == "request slots"
    small = CapacityGate(max_waiting=8, timeout_s=3.0, reserve=0.125)
    small.ledger.add("a", 1, 0)
    assert small._into_reserve(demand(), 2, 0) == "request slots"  # any reserve keeps a whole slot
