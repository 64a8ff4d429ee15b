"""The admin API is closed whenever any key is configured, worker URLs are checked, clients see
no internal address, a client leaving mid-stream is a logged 499 with both legs aborted (one
leaving right after `data: [DONE]` a 200 with nothing aborted), and finish reasons are OpenAI's."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from sglang_pd.deploy.router.pd.relay import ends_with_done, openai_finish_reasons

from .conftest import Cluster, RouterLog
from .test_bad_input import assert_openai_error

CHAT = "/v1/chat/completions"
API_KEY = "sk-client-admin-test"
ADMIN_KEY = "sk-admin-admin-test"


def test_workers_api_is_closed_when_only_client_keys_are_set(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(api_keys=(API_KEY,))) as running:
        client_auth = {"Authorization": f"Bearer {API_KEY}"}
        for method in ("GET", "POST", "DELETE"):
            resp = httpx.request(method, running.url + "/workers", headers=client_auth)
            assert_openai_error(resp, 403, code="admin_disabled")
            assert cluster.decodes[0].url not in resp.text
        assert httpx.get(running.url + "/v1/models", headers=client_auth).status_code == 200


@pytest.mark.parametrize(
    "url", ["not a url", "http://a b:80", "http://host_name:0", "ftp://x:1", "http://:80", "http://x:99999", 7]
)
def test_post_workers_validates_the_url(cluster_factory: Callable[..., Cluster], url: object) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(admin_key=ADMIN_KEY)) as running:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        resp = httpx.post(running.url + "/workers", json={"url": url, "role": "decode"}, headers=admin)
        assert_openai_error(resp, 400, param="url")
        listed = httpx.get(running.url + "/workers", headers=admin).json()
        assert len(listed["decode"]) == 1, "nothing was registered"


def test_mid_stream_disconnect_is_499_and_aborts_both_legs(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.02)
    caplog.set_level(logging.INFO, logger="sglang_pd.router")
    with cluster.serve(cluster.config()) as running:

        async def hang_up() -> str:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True}
            async with httpx.AsyncClient(timeout=10) as client:
                headers = {"x-request-id": "leaver"}
                async with client.stream("POST", running.url + CHAT, json=body, headers=headers) as resp:
                    seen = 0
                    async for _ in resp.aiter_raw():
                        seen += 1
                        if seen == 3:
                            break
            return resp.headers["x-router-request-id"]

        rid = asyncio.run(hang_up())  # the legs are aborted by the router's id, never the client's
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if all(rid in w.aborts for w in cluster.prefills + cluster.decodes):
                break
            time.sleep(0.02)
        assert all(rid in w.aborts for w in cluster.prefills + cluster.decodes)
        time.sleep(0.1)
    finished = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert any(getattr(r, "status", None) == 499 for r in finished), [vars(r) for r in finished]


@pytest.mark.parametrize("endpoint", [CHAT, "/generate"])
def test_client_leaving_after_done_is_a_success_without_aborts(
    cluster_factory: Callable[..., Cluster], router_log: RouterLog, endpoint: str
) -> None:
    # The decode's body ends a second after its `data: [DONE]`: the client has read the whole
    # answer and hangs up before the router sees the end of the upstream body.
    cluster = cluster_factory(1, 1, done_delay=1.0)
    with cluster.serve(cluster.config()) as running:

        async def read_to_done() -> bytes:
            if endpoint == CHAT:
                body: dict[str, object] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            else:
                body = {"text": "x", "sampling_params": {"max_new_tokens": 4}}
            async with httpx.AsyncClient(timeout=10) as client:
                headers = {"x-request-id": "done-reader"}
                stream = client.stream("POST", running.url + endpoint, json={**body, "stream": True}, headers=headers)
                async with stream as resp:
                    seen = b""
                    async for chunk in resp.aiter_raw():
                        seen += chunk
                        if b"data: [DONE]" in seen:
                            break
            return seen

        assert b"data: [DONE]" in asyncio.run(read_to_done())
        (line,) = router_log.finished("done-reader")
        assert line["status"] == 200, line
        time.sleep(1.2)  # past the decode's end of body: an abort sent on leaving would be there
        for worker in cluster.prefills + cluster.decodes:
            assert worker.aborts == [], (worker.url, worker.aborts)
    assert all(entry["msg"] != "stream stalled" for entry in router_log.entries)


def test_aborted_answer_reports_an_openai_finish_reason(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.02)
    decode = cluster.decodes[0]
    with cluster.serve(cluster.config()) as running:

        def abort_soon() -> None:
            time.sleep(0.3)
            (leg,) = decode.state()["requests"]
            asyncio.run(decode.handle("POST", "/abort_request", {}, orjson.dumps({"rid": leg["rid"]})))

        thread = threading.Thread(target=abort_soon)
        thread.start()
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200}
        resp = httpx.post(running.url + CHAT, json=body, timeout=10)
        thread.join()
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_finish_reason_mapping_on_bytes() -> None:
    assert openai_finish_reasons(b'data: {"finish_reason":"abort"}\n\n') == b'data: {"finish_reason":"length"}\n\n'
    assert openai_finish_reasons(b'{"finish_reason": "abort"}') == b'{"finish_reason": "length"}'
    untouched = b'{"finish_reason": "stop", "text": "abort"}'
    assert openai_finish_reasons(untouched) is untouched


def test_done_is_found_across_chunk_boundaries() -> None:
    assert ends_with_done(b"", b'data: {"x": 1}\n\ndata: [DONE]\n\n')
    assert ends_with_done(b'{"x": 1}\n\ndata: [DO', b"NE]\n\n")
    assert not ends_with_done(b"", b'data: {"text": "data: [DONE] is the end"}\n\n')
    assert not ends_with_done(b"", b'data: {"x": 1}\n\n')
