"""Prefill → Mooncake → decode behind our router: token identity, API formats, concurrency, aborts."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import PDStack, Proc, greedy_reference, read_registered_region

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

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
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7},
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
    body = {
        "text": "x" * 100,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }
    finish = None
    headers = {"x-request-id": "abort-me-1"}  # it does not name the request to the engines
    with httpx.stream("POST", f"{pd_stack.router.url}/generate", json=body, headers=headers, timeout=60) as s:
        rid = s.headers["x-router-request-id"]  # the router's own id, the one the engines know
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if finish is None and len(chunk["output_ids"]) == 3:
                assert chunk["meta_info"]["id"] == rid  # as the decode engine names the request
                assert pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") > 0
                assert httpx.post(f"{pd_stack.decode.url}/abort_request", json={"rid": rid}).status_code == 200
            finish = chunk["meta_info"]["finish_reason"]
    assert finish is not None and finish["type"] == "abort"
    deadline = time.monotonic() + 5
    while pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pd_stack.decode.metric("sglang_pd_refengine_kv_pages_used") == 0
    assert pd_stack.prefill.metric("sglang_pd_refengine_kv_pages_used") == 0


def _data_lines(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    return (json.loads(line[6:]) for line in lines if line.startswith("data: {"))


def _kv_rids(engine: Proc, event: str) -> set[str]:
    """The rids of the requests whose KV `engine` sent or received (its `kv_sent`/`kv_received` log lines)."""
    lines = [json.loads(line) for line in engine.log.read_text().splitlines() if line.startswith('{"ts"')]
    return {line["rid"] for line in lines if line.get("event") == event}


def test_a_reused_x_request_id_cannot_cut_another_clients_stream(pd_stack: PDStack) -> None:
    # Before the router named requests itself, a client that sent another's X-Request-ID (or `rid`)
    # and hung up made the router abort the other's request on both engines by that id.
    tokens = 300
    body = {
        "model": "tiny-deepseek-v3",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-request-id": "shared"}
    url = f"{pd_stack.router.url}/v1/chat/completions"
    decode, router = pd_stack.decode, pd_stack.router
    aborts = router.metric("sglang_pd_router_aborts_total")
    decode_aborted = decode.metric("sglang_pd_refengine_aborted_requests_total")
    # The attacker's request starts first: an engine keyed by rid holds the later one under it.
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body, headers=headers) as attacker:
        attacker_chunks = _data_lines(attacker.iter_lines())
        attacker_first = next(attacker_chunks)
        with client.stream("POST", url, json=body, headers=headers) as victim:
            victim_chunks = _data_lines(victim.iter_lines())
            received = [next(victim_chunks)]
            for _ in range(2):
                next(attacker_chunks)
            attacker_id = attacker.headers["x-router-request-id"]
            attacker.close()  # hangs up mid-stream: the router aborts its request on both engines
            deadline = time.monotonic() + 10
            while router.metric("sglang_pd_router_aborts_total") < aborts + 2:
                assert time.monotonic() < deadline, "the router never aborted the attacker's request"
                time.sleep(0.05)
            time.sleep(0.5)  # the aborts reach the engines
            # The decode aborted the attacker's request at most. Whether the victim still runs proves
            # nothing under load (it may have finished meanwhile); its whole answer below does.
            assert decode.metric("sglang_pd_refengine_aborted_requests_total") <= decode_aborted + 1
            received += list(victim_chunks)
    assert victim.status_code == 200 and victim.headers["x-request-id"] == "shared"
    victim_id = victim.headers["x-router-request-id"]
    assert received[-1]["usage"]["completion_tokens"] == tokens, "the victim's answer is whole"
    assert [c["choices"][0]["finish_reason"] for c in received if c["choices"]][-1] == "length"
    # Both engines knew the two requests by the router's two ids, never by the client's.
    assert attacker_id != victim_id
    assert attacker_first["id"] == f"chatcmpl-{attacker_id}" and received[0]["id"] == f"chatcmpl-{victim_id}"
    assert {attacker_id, victim_id} <= _kv_rids(pd_stack.prefill, "kv_sent")
    assert {attacker_id, victim_id} <= _kv_rids(decode, "kv_received")
    assert "shared" not in _kv_rids(pd_stack.prefill, "kv_sent") | _kv_rids(decode, "kv_received")


def test_freed_pages_read_as_zeros_from_the_registered_buffers(pd_stack: PDStack, reference_model) -> None:  # type: ignore[no-untyped-def]
    # A Mooncake peer can read an engine's whole registered KV buffer; once a request is done, no
    # page of either engine may still hold its KV (from which its prompt could be recovered).
    sent = pd_stack.prefill.metric("sglang_pd_kv_transfers_total")
    body = {"input_ids": _prompt(100), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    assert httpx.post(f"{pd_stack.router.url}/generate", json=body, timeout=60).status_code == 200
    assert pd_stack.prefill.metric("sglang_pd_kv_transfers_total") > sent  # the prompt's KV was paged
    for engine in (pd_stack.prefill, pd_stack.decode):
        assert engine.metric("sglang_pd_refengine_kv_pages_used") == 0
        info = httpx.get(f"{engine.url}/server_info").json()
        shape = reference_model.kv_shape
        nbytes = shape.num_buffers * info["kv_pages"] * shape.page_bytes(info["page_size"], element_bytes=4)
        region = read_registered_region(info["kv_session_id"], nbytes)
        assert region.count_nonzero() == 0, f"{engine.name}: freed KV pages still hold data"


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
    # sglang's two error shapes: flat on its OpenAI routes, nested on its native ones
    assert r.status_code == 400 and "messages" in r.json()["message"] and r.json()["object"] == "error"
    r = httpx.post(f"{url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 10**6}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
