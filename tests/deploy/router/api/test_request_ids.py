"""Request ids do not cross clients: the engines know each request by the router's own id, new for
every request; a client's X-Request-ID is only logged and echoed, and a `rid` in its body is
replaced. A client that reuses another's X-Request-ID and hangs up aborts only its own request."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable
from typing import Any

import httpx

from sglang_pd.deploy.router.pd.bootstrap import pd_bodies
from tests.support.polling import wait_until

from ..conftest import Cluster, RouterLog, RunningRouter

CHAT = "/v1/chat/completions"
TOKENS = 60
ROUTER_ID = re.compile(r"^[0-9a-f]{32}$")


def _stream_body(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": TOKENS, "stream": True}


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def test_a_client_reusing_another_ones_request_id_cannot_cut_its_stream(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(1, 1, processes=True, token_delay=0.02)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    headers = {"x-request-id": "shared"}
    with cluster.serve(cluster.config()) as running:

        async def scenario() -> tuple[str, str, httpx.Response, bytes]:
            # The attacker's request starts first, so that an engine keyed by rid would hold the
            # victim's request under the shared id when the attacker hangs up.
            async with (
                httpx.AsyncClient(timeout=20) as client,
                client.stream("POST", running.url + CHAT, json=_stream_body("a"), headers=headers) as a,
            ):
                attacker_chunks = a.aiter_raw()
                await attacker_chunks.__anext__()
                async with client.stream("POST", running.url + CHAT, json=_stream_body("v"), headers=headers) as victim:
                    victim_chunks = victim.aiter_raw()
                    received = [await victim_chunks.__anext__()]
                    for _ in range(2):
                        await attacker_chunks.__anext__()
                    await a.aclose()  # the attacker hangs up mid-stream
                    attacker_id = a.headers["x-router-request-id"]
                    while attacker_id not in decode.state()["aborts"]:
                        await asyncio.sleep(0.02)
                    received += [chunk async for chunk in victim_chunks]
                    return attacker_id, victim.headers["x-router-request-id"], victim, b"".join(received)

        attacker_id, victim_id, victim, body = asyncio.run(scenario())
    assert victim.status_code == 200 and victim.headers["x-request-id"] == "shared"
    events = _events(body)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert len(re.findall(r" tok\d+", content)) == TOKENS, body[-300:]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # The engines saw two distinct ids, both the router's; only the attacker's was aborted.
    assert ROUTER_ID.match(attacker_id) and ROUTER_ID.match(victim_id) and attacker_id != victim_id
    for worker in (prefill, decode):
        state = worker.state()
        assert sorted(leg["rid"] for leg in state["requests"]) == sorted([attacker_id, victim_id])
        assert victim_id not in state["aborts"] and "shared" not in state["aborts"]


def test_answers_echo_the_client_id_and_logs_carry_both(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter, router_log: RouterLog
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    routed = set()
    for stream in (False, True):
        resp = httpx.post(router_1p1d.url + CHAT, json={**body, "stream": stream}, headers={"x-request-id": "mine-1"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "mine-1"
        routed.add(resp.headers["x-router-request-id"])
    assert len(routed) == 2 and all(ROUTER_ID.match(rid) for rid in routed)
    assert {line["request_id"] for line in router_log.finished("mine-1", count=2)} == routed
    # An X-Request-ID that is no sane token is dropped: the answer carries the router's id.
    refused = httpx.post(router_1p1d.url + CHAT, json={"messages": []}, headers={"x-request-id": "a b"})
    assert refused.status_code == 400
    assert refused.headers["x-request-id"] == refused.headers["x-router-request-id"]
    rid = refused.headers["x-router-request-id"]
    wait_until(lambda: any(e.get("request_id") == rid for e in router_log.entries))
    assert all("client_request_id" not in e for e in router_log.entries if e.get("request_id") == rid)


def test_a_rid_in_the_body_is_refused_and_never_reaches_the_engines(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter
) -> None:
    prefill, decode = cluster_1p1d.prefills[0], cluster_1p1d.decodes[0]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "rid": "someone-else"}
    batch = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 1}, "rid": ["someone-else", "x"]}
    before = [len(w.state()["requests"]) for w in (prefill, decode)]
    for path, body in ((CHAT, chat), ("/generate", batch)):
        resp = httpx.post(router_1p1d.url + path, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "rid" and resp.json()["error"]["code"] == "internal_field"
    assert [len(w.state()["requests"]) for w in (prefill, decode)] == before


def test_an_admin_request_may_send_a_rid_and_the_engines_still_see_the_routers(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(1, 1)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    batch = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 1}, "rid": ["someone-else", "x"]}
    with cluster.serve(cluster.config(api_keys=("client",), admin_key="admin")) as running:
        as_client = httpx.post(running.url + "/generate", json=batch, headers={"authorization": "Bearer client"})
        assert as_client.status_code == 400 and as_client.json()["error"]["param"] == "rid"
        resp = httpx.post(running.url + "/generate", json=batch, headers={"authorization": "Bearer admin"})
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-router-request-id"]
    for worker in (prefill, decode):
        assert worker.state()["requests"][-1]["rid"] == [f"{rid}-0", f"{rid}-1"]


def test_the_legs_bodies_carry_the_routers_rid_over_the_clients() -> None:
    bodies = pd_bodies({"rid": "theirs", "text": "x"}, host="h", port=1, rooms=[5], ranks=[], rid="ours", batch=None)
    assert json.loads(bodies.prefill)["rid"] == json.loads(bodies.decode)["rid"] == "ours"
    assert bodies.rids == ["ours"]


def test_router_ids_are_new_in_a_forked_process() -> None:
    # Ids come from a batch of os.urandom; a child of a fork (a router process group's serving
    # process) must not hand out the ids its parent will.
    from sglang_pd.deploy.router.api.request_ids import _RandomIds, request_ids

    ids = {request_ids({"headers": []}).router for _ in range(1000)}
    assert len(ids) == 1000 and all(ROUTER_ID.match(i) for i in ids)

    def child_and_parent(source: _RandomIds) -> tuple[str, str]:
        source.next()  # a batch drawn before the fork
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, source.next().encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = os.read(read, 64).decode()
        os.close(read)
        os.close(write)
        return child, source.next()

    child, parent = child_and_parent(_RandomIds())
    assert child != parent

    # The control: without the reset at fork, the child repeats its parent's next id.
    class Unreset(_RandomIds):
        def __init__(self) -> None:  # no at-fork hook
            self._pool, self._at = b"", 0

    child, parent = child_and_parent(Unreset())
    assert child == parent
