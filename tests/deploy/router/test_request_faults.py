"""Request-caused failures never take a worker out of service: out-of-range sampling parameters
and absurd JSON get a 400 naming the parameter from the router, an engine's own refusal comes
back in the one OpenAI error shape, breaker transitions are logged, and a 502 names no internal
address. One test runs the real reference engines with the numerically extreme values that
used to crash their sampler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from sglang_pd.deploy.common.openai_errors import normalize_error_body
from sglang_pd.deploy.router.api.validation import MAX_JSON_DEPTH
from sglang_pd.deploy.router.workers.breaker import BreakerState
from tests.deploy.refengine.conftest import launcher
from tests.support.polling import wait_until

from .conftest import Cluster, RunningRouter
from .test_bad_input import assert_openai_error

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, _chat(temperature=5), "temperature"),
        (CHAT, _chat(temperature=-1), "temperature"),
        (CHAT, _chat(top_p=0), "top_p"),
        (CHAT, _chat(top_p=1.5), "top_p"),
        (CHAT, _chat(presence_penalty=3), "presence_penalty"),
        (CHAT, _chat(frequency_penalty=-2.5), "frequency_penalty"),
        (CHAT, _chat(n=0), "n"),
        (CHAT, _chat(n=1000), "n"),
        (CHAT, _chat(max_tokens=0), "max_tokens"),
        (CHAT, _chat(max_completion_tokens=-3), "max_completion_tokens"),
        (CHAT, _chat(logprobs=True, top_logprobs=25), "top_logprobs"),
        (CHAT, _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (CHAT, _chat(top_logprobs=2), "top_logprobs"),
        (CHAT, _chat(logprobs="yes"), "logprobs"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (COMPLETIONS, {"prompt": "hi", "temperature": 2.5}, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 6}, "logprobs"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (GENERATE, {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        (GENERATE, {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (GENERATE, {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        (GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        (GENERATE, {"text": ["a"], "sampling_params": [{"min_p": 2}]}, "sampling_params[0].min_p"),
    ],
)
def test_out_of_range_parameter_is_400_naming_it(
    router_1p1d: RunningRouter, path: str, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(router_1p1d.url + path, json=body, timeout=10)
    assert_openai_error(resp, 400, param=param)
    assert param.split(".")[-1].split("[")[0] in resp.json()["error"]["message"]


def test_every_openai_role_is_accepted(router_1p1d: RunningRouter) -> None:
    messages = [{"role": r, "content": "x"} for r in ("developer", "system", "user", "assistant", "tool", "user")]
    resp = httpx.post(router_1p1d.url + CHAT, json={"messages": messages, "max_tokens": 1}, timeout=10)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 254, 255, 1023, 5000])
def test_deep_json_is_400(router_1p1d: RunningRouter, depth: int) -> None:
    content = b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"
    resp = httpx.post(router_1p1d.url + CHAT, content=content, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, code="invalid_json")


def test_shallow_brackets_are_fine(router_1p1d: RunningRouter) -> None:
    # Many brackets, little depth: the depth walk runs and lets it through.
    body = {"prompt": [[1, 2]] * 200, "max_tokens": 1}
    resp = httpx.post(router_1p1d.url + COMPLETIONS, json=body, timeout=10)
    assert resp.status_code == 200, resp.text


def test_bad_requests_never_trip_the_breaker(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(breaker_failure_threshold=2)) as running, httpx.Client(timeout=10) as client:
        bad = [_chat(top_p=0), _chat(temperature=float(3)), {"messages": [{"role": "wizard", "content": "x"}]}]
        for i in range(30):
            assert client.post(running.url + CHAT, json=bad[i % len(bad)]).status_code == 400
        # The engine's own 4xx refusals do not count either.
        cluster.decodes[0].configure(fail_status=400, fail_count=5)
        for _ in range(5):
            assert client.post(running.url + CHAT, json=_chat()).status_code == 400
        for worker in running.app.registry.all():
            assert worker.breaker.state is BreakerState.CLOSED and worker.breaker.failures == 0
        assert client.get(running.url + "/readiness").status_code == 200
        assert client.post(running.url + CHAT, json=_chat(top_p=5e-324, temperature=1e-50)).status_code == 200


def test_breaker_transitions_are_logged_and_502_hides_worker_addresses(
    cluster_factory: Callable[..., Cluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory(1, 1)
    decode = cluster.decodes[0]
    # The 5xx count once a probe confirms them (/v1/models fails too); failed probes alone never eject.
    config = cluster.config(
        breaker_failure_threshold=2, breaker_cooldown_s=0.2, max_retries=0, health_failure_threshold=100
    )
    with cluster.serve(config) as running, httpx.Client(timeout=10) as client:
        caplog.set_level(logging.INFO, logger="sglang_pd.router")
        decode.configure(fail_status=500, fail_count=2, models_status=500)
        for _ in range(2):
            resp = client.post(running.url + CHAT, json=_chat())
            assert_openai_error(resp, 502, code="upstream_error")
            text = resp.text
            assert "http://" not in text and "127.0.0.1" not in text and decode.url not in text
        worker = running.app.registry.get(decode.url, "decode")
        assert worker is not None
        # The confirmation probes run in the background.
        wait_until(lambda: worker.breaker.state is BreakerState.OPEN)
        decode.configure(models_status=200)
        # After the cooldown one probe request goes through, succeeds, and closes the breaker.
        time.sleep(0.25)
        assert client.post(running.url + CHAT, json=_chat()).status_code == 200
    messages = [(r.getMessage(), getattr(r, "worker", "")) for r in caplog.records]
    for transition in ("closed -> open", "open -> half_open", "half_open -> closed"):
        assert (f"circuit breaker {transition}", f"decode {worker.url}") in messages, messages
    failed = [r for r in caplog.records if r.getMessage() == "request failed on every attempt"]
    assert failed and getattr(failed[0], "worker", "") == worker.url, "the address stays in the log"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"object": "error", "message": "n > 1 unsupported", "type": "BadRequestError", "code": 400}', "n > 1"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"plain text failure", "plain text failure"),
        (b'{"error": {"message": "kept", "type": "x", "param": "top_p", "code": "c"}}', "kept"),
    ],
)
def test_engine_errors_are_rewritten_to_the_openai_shape(body: bytes, message: str) -> None:
    error = orjson.loads(normalize_error_body(400, body))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_reference_engines_survive_extreme_sampling(tmp_path: Path) -> None:
    """Real prefill and decode reference engines behind the router's CLI: values that used to
    crash the sampler (NaN from a tiny temperature, nothing kept by a tiny top_p) now answer 200,
    out-of-range ones get the router's 400, and the service stays ready throughout."""
    with launcher(tmp_path) as lx:
        prefill, decode = lx.engine("prefill"), lx.engine("decode")
        router = lx.router(prefill, decode)
        lx.wait()
        with httpx.Client(base_url=router.url, timeout=60) as client:
            for extreme in ({"top_p": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-50}, {"temperature": 2}):
                for stream in (False, True):
                    resp = client.post(CHAT, json=_chat(stream=stream, max_tokens=3, **extreme))
                    assert resp.status_code == 200, (extreme, resp.text)
                    assert b'"error"' not in resp.content
                resp = client.post(GENERATE, json={"text": "hi", "sampling_params": {"max_new_tokens": 2, **extreme}})
                assert resp.status_code == 200, (extreme, resp.text)
            for bad in ({"temperature": 5}, {"top_p": 0}, {"n": 3, "temperature": -1}):
                assert client.post(CHAT, json=_chat(**bad)).status_code == 400
            # n=3 is in OpenAI's range but the reference engine refuses it: its 400, reshaped.
            resp = client.post(CHAT, json=_chat(n=3))
            assert_openai_error(resp, 400)
            # Fields sglang honours and the reference engine does not: a 400 naming them, not ignored.
            unsupported = [
                (CHAT, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
                (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
                (COMPLETIONS, {"echo": True}, "echo"),
                (COMPLETIONS, {"suffix": "end"}, "suffix"),
                (COMPLETIONS, {"best_of": 2}, "best_of"),
            ]
            for path, extra, param in unsupported:
                base = _chat() if path == CHAT else {"prompt": "hi", "max_tokens": 2}
                assert_openai_error(client.post(path, json={**base, **extra}), 400, param=param)
            assert (
                client.post(CHAT, json=_chat(response_format={"type": "text"}, tool_choice="none")).status_code == 200
            )
            assert client.get("/readiness").status_code == 200
            workers = client.get("/workers").json()
            assert all(w["breaker"] == "closed" for w in workers["prefill"] + workers["decode"]), workers
