"""The official openai client (sync and async, streaming and not) through the router, in front of
protocol-faithful PD test workers (in process); plus the PD protocol details the workers check."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import openai

from .conftest import Cluster, RunningRouter

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_sync_chat(router_1p1d: RunningRouter) -> None:
    client = openai.OpenAI(base_url=router_1p1d.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
    assert out.choices[0].message.content == " tok0 tok1 tok2 tok3 tok4"
    assert out.usage is not None and out.usage.completion_tokens == 5
    client.close()


def test_sync_chat_stream(router_1p1d: RunningRouter) -> None:
    client = openai.OpenAI(base_url=router_1p1d.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="test-model",
        messages=MESSAGES,
        max_tokens=4,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == " tok0 tok1 tok2 tok3"
    assert usage is not None and usage.completion_tokens == 4
    client.close()


def test_sync_completions_and_models(router_1p1d: RunningRouter) -> None:
    client = openai.OpenAI(base_url=router_1p1d.url + "/v1", api_key="unused")
    out = client.completions.create(model="test-model", prompt="Say hi", max_tokens=3)
    assert out.choices[0].text == " tok0 tok1 tok2"
    assert [m.id for m in client.models.list()] == ["test-model"]
    client.close()


def test_async_chat_and_stream_concurrently(router_1p1d: RunningRouter) -> None:
    async def scenario() -> None:
        client = openai.AsyncOpenAI(base_url=router_1p1d.url + "/v1", api_key="unused")

        async def unary(i: int) -> str:
            out = await client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
            return out.choices[0].message.content or ""

        async def streamed(i: int) -> str:
            stream = await client.completions.create(model="test-model", prompt=f"p{i}", max_tokens=3, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        results = await asyncio.gather(*[unary(i) for i in range(8)], *[streamed(i) for i in range(8)])
        assert results == [" tok0 tok1 tok2"] * 16
        await client.close()

    asyncio.run(scenario())


def test_router_request_id_reaches_both_legs_with_bootstrap_fields(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter
) -> None:
    prefill, decode = cluster_1p1d.prefills[0], cluster_1p1d.decodes[0]
    resp = httpx.post(
        router_1p1d.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1},
        headers={"X-Request-ID": "req-abc-123"},
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "req-abc-123"
    rid = resp.headers["x-router-request-id"]
    seen = [w.state()["requests"] for w in (prefill, decode)]
    (p,) = [r for r in seen[0] if r["rid"] == rid]
    (d,) = [r for r in seen[1] if r["rid"] == rid]
    assert p["room"] == d["room"] and 0 <= p["room"] < 2**63
    assert p["host"] == d["host"] == urlsplit(prefill.url).hostname
    assert p["port"] == d["port"] == prefill.bootstrap_port
    generated = httpx.post(router_1p1d.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert len(generated.headers["x-request-id"]) == 32
    assert generated.headers["x-request-id"] == generated.headers["x-router-request-id"]


def test_batch_generate_gets_lists_and_merged_input_logprobs(router_1p1d: RunningRouter) -> None:
    body = {"text": ["one two three", "four"], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    resp = httpx.post(router_1p1d.url + "/generate", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert len(out) == 2
    for item in out:
        # The prefill's input logprobs (2 prompt tokens in the test worker's count) come first.
        assert len(item["meta_info"]["input_token_logprobs"]) == 2
        assert len(item["meta_info"]["output_token_logprobs"]) == 2


def test_streaming_generate_merges_logprobs_into_first_event(router_1p1d: RunningRouter) -> None:
    body = {"text": "a b c", "return_logprob": True, "stream": True, "sampling_params": {"max_new_tokens": 2}}
    with httpx.stream("POST", router_1p1d.url + "/generate", json=body) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: {")]
    assert '"input_token_logprobs": [[' in events[0].replace('":[[', '": [[')
