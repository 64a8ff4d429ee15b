"""Bad input gets the right 4xx with an OpenAI-shaped error; a fuzz run gets no 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Cluster, RunningRouter

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

API_KEY = "sk-client-0123456789"
ADMIN_KEY = "sk-admin-9876543210"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded(cluster_1p1d: Cluster) -> Iterator[RunningRouter]:
    config = cluster_1p1d.config(api_keys=(API_KEY, "sk-second"), admin_key=ADMIN_KEY, max_body_bytes=4096)
    with cluster_1p1d.serve(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(guarded: RunningRouter) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=10) as c:
        yield c


def assert_openai_error(
    resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 20
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "content", "param", "code"),
    [
        (CHAT, b"{not json", None, "invalid_json"),
        (CHAT, b"", None, "invalid_json"),
        (CHAT, b"[1, 2]", None, "invalid_json"),
        (CHAT, b'{"model": "test-model"}', "messages", "missing_required_parameter"),
        (CHAT, b'{"messages": []}', "messages", "invalid_type"),
        (CHAT, b'{"messages": "hi"}', "messages", "invalid_type"),
        (CHAT, b'{"messages": [{"content": "hi"}]}', "messages[0].role", "invalid_type"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens", "invalid_type"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens", "invalid_value"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream", "invalid_type"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature", None),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": 7}', "model", "invalid_type"),
        ("/v1/completions", b'{"model": "test-model"}', "prompt", "missing_required_parameter"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt", "invalid_type"),
        ("/generate", b'{"sampling_params": {}}', "text", "missing_required_parameter"),
        ("/generate", b'{"text": 5}', "text", "invalid_type"),
        # The logprob options of /generate, which sglang bounds in no way.
        ("/generate", b'{"text": "x", "top_logprobs_num": 100000}', "top_logprobs_num", "invalid_value"),
        ("/generate", b'{"text": ["x", "y"], "top_logprobs_num": [1, 21]}', "top_logprobs_num", "invalid_value"),
        ("/generate", b'{"text": "x", "top_logprobs_num": "all"}', "top_logprobs_num", "invalid_type"),
        ("/generate", b'{"text": "x", "logprob_start_len": -5}', "logprob_start_len", "invalid_value"),
        ("/generate", b'{"text": "x", "token_ids_logprob": [1, "a"]}', "token_ids_logprob", "invalid_type"),
        (
            "/generate",
            b'{"text": "x", "token_ids_logprob": [' + b",".join(b"%d" % i for i in range(65)) + b"]}",
            "token_ids_logprob",
            "invalid_value",
        ),
    ],
)
def test_bad_body_is_400(client: httpx.Client, path: str, content: bytes, param: str | None, code: str | None) -> None:
    resp = client.post(path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, param=param, code=code)
    assert resp.headers["x-request-id"]


def test_bounded_generate_logprob_options_pass(client: httpx.Client) -> None:
    # Control for the bounds above: the same options within them reach the workers and answer.
    body = {"text": "x", "return_logprob": True, "top_logprobs_num": 20, "logprob_start_len": -1,
            "token_ids_logprob": list(range(64)), "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    assert client.post("/generate", json=body).status_code == 200


def test_unknown_model_is_404(client: httpx.Client) -> None:
    resp = client.post(CHAT, json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(resp, 404, param="model", code="model_not_found")
    assert "test-model" in resp.json()["error"]["message"]


def test_oversized_body_is_413(client: httpx.Client) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(client.post(CHAT, json=big), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    assert_openai_error(client.post(CHAT, content=chunks()), 413, code="request_too_large")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}])
def test_bad_api_key_is_401(guarded: RunningRouter, headers: dict[str, str]) -> None:
    resp = httpx.post(guarded.url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}, headers=headers)
    assert_openai_error(resp, 401, code="invalid_api_key")
    assert resp.headers["www-authenticate"] == "Bearer"
    assert_openai_error(httpx.get(guarded.url + "/v1/models", headers=headers), 401)


def test_second_api_key_works_and_open_paths_need_none(guarded: RunningRouter) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert httpx.post(guarded.url + CHAT, json=body, headers={"Authorization": "Bearer sk-second"}).status_code == 200
    for path in ("/health", "/readiness", "/metrics"):
        assert httpx.get(guarded.url + path).status_code == 200


def test_workers_api_needs_the_admin_key(guarded: RunningRouter) -> None:
    assert_openai_error(httpx.get(guarded.url + "/workers", headers=AUTH), 401)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(guarded.url + "/workers", headers=admin).json()
    assert len(listed["prefill"]) == 1 and len(listed["decode"]) == 1
    assert_openai_error(
        httpx.post(guarded.url + "/workers", json={"url": "ftp://x", "role": "decode"}, headers=admin), 400
    )
    assert_openai_error(
        httpx.post(guarded.url + "/workers", json={"url": "http://x:1", "role": "router"}, headers=admin), 400
    )
    assert_openai_error(httpx.delete(guarded.url + "/workers", params={"url": "http://nope:1"}, headers=admin), 404)


def test_workers_api_is_read_only_without_admin_key(router_1p1d: RunningRouter) -> None:
    assert httpx.get(router_1p1d.url + "/workers").status_code == 200
    resp = httpx.post(router_1p1d.url + "/workers", json={"url": "http://127.0.0.1:1", "role": "decode"})
    assert_openai_error(resp, 403, code="admin_disabled")


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get(CHAT), 405)


# -- fuzz ---------------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | json_value},
    optional={"content": st.text(max_size=40) | json_value, "name": json_value},
)
known_field = st.sampled_from(
    ["model", "messages", "prompt", "text", "input_ids", "max_tokens", "max_completion_tokens", "stream",
     "temperature", "top_p", "n", "stop", "stream_options", "sampling_params", "return_logprob", "seed",
     "logprobs", "rid", "bootstrap_room", "bootstrap_host", "tools", "user"]
)  # fmt: skip
field_value = st.one_of(
    json_value,
    st.lists(message, min_size=0, max_size=3),
    st.integers(0, 64),
    st.sampled_from(["test-model", "other-model", ""]),
    st.lists(st.integers(0, 50000), max_size=8),
)
body = st.one_of(
    st.dictionaries(known_field, field_value, max_size=8),
    st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3)},
        optional={"model": st.just("test-model"), "max_tokens": st.integers(0, 8), "stream": st.booleans()},
    ),
    st.fixed_dictionaries({"prompt": field_value}, optional={"max_tokens": st.integers(0, 8), "stream": st.booleans()}),
    json_value,
)
raw = st.one_of(body.map(lambda b: ("json", b)), st.binary(max_size=64).map(lambda b: ("raw", b)))


@settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]), payload=raw)
def test_fuzz_never_5xx(client: httpx.Client, endpoint: str, payload: tuple[str, Any]) -> None:
    kind, value = payload
    if kind == "json":
        resp = client.post(endpoint, json=value)
    else:
        resp = client.post(endpoint, content=value, headers={"content-type": "application/json"})
    assert resp.status_code < 500, (endpoint, value, resp.status_code, resp.text)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)
