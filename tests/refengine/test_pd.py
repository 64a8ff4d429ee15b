"""Prefill → Mooncake → decode behind our router: token identity, API formats, concurrency, aborts."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx

from .conftest import PDStack, greedy_reference

NEW_TOKENS = 10
# 20 prompt lengths from 1 to 400 tokens, around the 16-token page boundaries.
LENGTHS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129, 255, 399, 400]


def _prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(2, 258) for _ in range(n)]


def test_pd_greedy_is_token_identical_to_single_process(pd_stack: PDStack, reference_model) -> None:  # type: ignore[no-untyped-def]
    def one(n: int) -> tuple[int, list[int]]:
        body = {
            "input_ids": _prompt(n),
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(f"{pd_stack.router.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return n, r.json()["output_ids"]

    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(*one(n))) for n in LENGTHS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == sorted(LENGTHS)
    for n in LENGTHS:
        assert results[n] == greedy_reference(reference_model, _prompt(n), NEW_TOKENS), f"prompt of {n} tokens"
    # every transfer went through Mooncake, and every page came back
    assert pd_stack.prefill.metric("sglang_pd_kv_transfers_total") >= len(LENGTHS)
    assert pd_stack.prefill.metric("sglang_pd_refengine_kv_pages_used") == 0
    assert pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") == 0


def test_sampling_with_a_seed_is_reproducible_through_pd(pd_stack: PDStack) -> None:
    body = {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    }
    a = httpx.post(f"{pd_stack.router.url}/generate", json=body, timeout=60).json()["output_ids"]
    b = httpx.post(f"{pd_stack.router.url}/generate", json=body, timeout=60).json()["output_ids"]
    assert a == b and len(a) <= 8


def test_chat_completions_json_and_stream(pd_stack: PDStack) -> None:
    body = {
        "model": "tiny-deepseek-v3",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    r = httpx.post(f"{pd_stack.router.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["object"] == "chat.completion" and full["usage"]["completion_tokens"] >= 1
    text = ""
    with httpx.stream(
        "POST", f"{pd_stack.router.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_completions_and_introspection(pd_stack: PDStack) -> None:
    body = {"model": "tiny-deepseek-v3", "prompt": "2 + 2 =", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{pd_stack.router.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    for engine in (pd_stack.prefill, pd_stack.decode):
        assert httpx.get(f"{engine.url}/health_generate", timeout=30).status_code == 200
        assert httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"] == "tiny-deepseek-v3"
        assert "weights_digest" in httpx.get(f"{engine.url}/get_model_info").json()
    info = httpx.get(f"{pd_stack.prefill.url}/server_info").json()
    assert (
        info["disaggregation_mode"] == "prefill"
        and info["disaggregation_bootstrap_port"] == pd_stack.prefill.bootstrap_port
    )


def test_short_request_is_not_blocked_by_a_long_one(pd_stack: PDStack) -> None:
    long_body = {"text": "long", "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    done: dict[str, float] = {}

    def long_req() -> None:
        httpx.post(f"{pd_stack.router.url}/generate", json=long_body, timeout=120)
        done["long"] = time.monotonic()

    t = threading.Thread(target=long_req)
    t.start()
    time.sleep(0.5)
    short = {"text": "short", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{pd_stack.router.url}/generate", json=short, timeout=60)
    done["short"] = time.monotonic()
    t.join(120)
    assert r.status_code == 200
    assert done["short"] < done["long"]


def test_abort_frees_pages_on_both_sides(pd_stack: PDStack) -> None:
    rid = "abort-me-1"
    body = {
        "rid": rid,
        "text": "x" * 100,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }
    finish = None
    # the router names the request after its x-request-id and passes that on as rid
    headers = {"x-request-id": rid}
    with httpx.stream("POST", f"{pd_stack.router.url}/generate", json=body, headers=headers, timeout=60) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if finish is None and len(chunk["output_ids"]) == 3:
                assert pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") > 0
                assert httpx.post(f"{pd_stack.decode.url}/abort_request", json={"rid": rid}).json()["aborted"] == 1
            finish = chunk["meta_info"]["finish_reason"]
    assert finish is not None and finish["type"] == "abort"
    deadline = time.monotonic() + 5
    while pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") == 0
    assert pd_stack.prefill.metric("sglang_pd_refengine_kv_pages_used") == 0


def test_client_disconnect_frees_pages(pd_stack: PDStack) -> None:
    body = {"text": "y" * 50, "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", f"{pd_stack.decode.url}/generate", json=body, timeout=60) as s:
        for n, _ in enumerate(s.iter_lines()):
            if n > 6:
                break  # close the connection mid-stream
    deadline = time.monotonic() + 5
    while pd_stack.decode.metric("sglang_pd_refengine_running_requests") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pd_stack.decode.metric("sglang_pd_refengine_running_requests") == 0


def test_bad_requests_are_clean_4xx(pd_stack: PDStack) -> None:
    url = pd_stack.decode.url
    assert httpx.post(f"{url}/generate", content=b"{not json").status_code == 400
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 10**6}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
