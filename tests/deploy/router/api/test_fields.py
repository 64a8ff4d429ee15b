"""Only allowlisted fields reach the engines (`router/api/fields.py`), with OpenAI's limits on them:
a real router in front of fake workers, each refusal checked to leave the workers untouched."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.api.fields import INTERNAL_FIELDS

from ..conftest import Cluster, RunningRouter

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]

# One value per field that a client could use against other clients or the engine's host.
DANGEROUS: dict[str, Any] = {
    "lora_path": "/etc/passwd",
    "custom_logit_processor": '{"callable": "gASVIAAAAAAAAACMCGJ1aWx0aW5zlIwEZXZhbJSTlC4="}',
    "custom_params": {"x": 1},
    "return_hidden_states": True,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
    "disagg_prefill_dp_rank": 0,
    "session_params": {"id": "victim"},
    "bootstrap_room": 7,
    "priority": 1000,
}


def _sent(cluster: Cluster) -> list[int]:
    return [len(w.state()["requests"]) for w in cluster.prefills + cluster.decodes]


def test_every_dangerous_field_is_an_internal_one() -> None:
    assert set(DANGEROUS) <= INTERNAL_FIELDS


@pytest.mark.parametrize("name", sorted(DANGEROUS))
def test_internal_fields_are_refused_on_every_route_naming_the_field(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter, name: str
) -> None:
    before = _sent(cluster_1p1d)
    for path, body, param in (
        (CHAT, {"messages": MESSAGES, name: DANGEROUS[name]}, name),
        ("/v1/completions", {"prompt": "hi", name: DANGEROUS[name]}, name),
        ("/generate", {"text": "hi", name: DANGEROUS[name]}, name),
    ):
        resp = httpx.post(router_1p1d.url + path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and error["code"] == "internal_field"
        assert "admin key" in error["message"]
    assert _sent(cluster_1p1d) == before


def test_custom_params_inside_generate_sampling_params_are_refused(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter
) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "custom_params": {"x": 1}}}
    resp = httpx.post(router_1p1d.url + "/generate", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "sampling_params.custom_params"


def test_an_unknown_field_is_refused_as_openai_refuses_it(cluster_1p1d: Cluster, router_1p1d: RunningRouter) -> None:
    resp = httpx.post(router_1p1d.url + CHAT, json={"messages": MESSAGES, "max_tokenz": 3})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "max_tokenz" and error["code"] == "unknown_parameter"
    assert error["message"].startswith("Unrecognized request argument supplied: max_tokenz.")


def test_openai_and_documented_sglang_fields_pass(cluster_1p1d: Cluster, router_1p1d: RunningRouter) -> None:
    chat = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "user": "u-1",
        "metadata": {"team": "a"},
        "stop": ["\n", "###"],
        "logit_bias": {"50256": -100},
        "top_k": 20,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "separate_reasoning": True,
    }
    assert httpx.post(router_1p1d.url + CHAT, json=chat).status_code == 200
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["a"], "stop_token_ids": [2]}}
    assert httpx.post(router_1p1d.url + "/generate", json=generate).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, "stop"),
        ("/generate", {"text": "x", "sampling_params": {"stop": ["a"] * 5}}, "sampling_params.stop"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"1": 101}}, "logit_bias.1"),
        (CHAT, {"messages": MESSAGES, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}] * 129}, "tools"),
    ],
    ids=["chat-stop", "completions-stop", "generate-stop", "logit-bias", "metadata", "tools"],
)
def test_openais_documented_limits_are_enforced(
    cluster_1p1d: Cluster, router_1p1d: RunningRouter, path: str, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(router_1p1d.url + path, json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_a_million_stop_sequences_are_refused_at_once(cluster_1p1d: Cluster, router_1p1d: RunningRouter) -> None:
    body = {"messages": MESSAGES, "stop": ["s"] * 1_500_000}
    started = time.monotonic()
    resp = httpx.post(router_1p1d.url + CHAT, json=body, timeout=30)
    elapsed = time.monotonic() - started
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert elapsed < 5.0, f"refusing 1.5 million stop strings took {elapsed:.1f} s"
