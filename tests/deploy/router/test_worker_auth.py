"""The worker key between the router and real reference engines: the engines refuse every route
without it (the main API and the prefill's bootstrap API), and the router's probes, legs and the
decode's KV claims carry it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from sglang_pd.deploy.router.transport.client import HttpWorkerClient
from tests.deploy.refengine.conftest import launcher

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

WORKER_KEY = "sk-worker-0123456789"


def test_reference_engines_require_the_worker_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_WORKER_API_KEY, WORKER_KEY)  # inherited by the engines and the router
    with launcher(tmp_path) as lx:
        prefill, decode = lx.engine("prefill"), lx.engine("decode")
        router = lx.router(prefill, decode)
        lx.wait(router)  # ready: the router's probes passed with the key
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for stream in (False, True):
            resp = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
            assert resp.status_code == 200 and b'"error"' not in resp.content, resp.text

        bootstrap = f"http://127.0.0.1:{prefill.bootstrap_port}"
        calls = [
            ("POST", decode.url + "/abort_request", {"abort_all": True}),
            ("POST", prefill.url + "/abort_request", {"abort_all": True}),
            ("GET", decode.url + "/health", None),
            ("GET", prefill.url + "/v1/models", None),
            ("POST", decode.url + "/generate", {"text": "x"}),
            ("POST", bootstrap + "/kv/claim", {}),
            ("GET", bootstrap + "/health", None),
        ]
        for method, url, payload in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": WORKER_KEY}):
                resp = httpx.request(method, url, json=payload, headers=headers, timeout=10)
                assert resp.status_code == 401, (method, url, headers, resp.status_code)
                assert resp.json() == {"error": "Unauthorized"}  # sglang's add_api_key_middleware answer
        good = {"Authorization": f"Bearer {WORKER_KEY}"}
        assert httpx.get(decode.url + "/health", headers=good, timeout=10).status_code == 200
        assert httpx.get(bootstrap + "/health", headers=good, timeout=10).status_code == 200


@pytest.mark.parametrize("key", ["key\n", "two words", "k\r\nx-injected: 1"])
def test_a_worker_key_no_header_can_carry_is_refused(key: str) -> None:
    # The key is written into every request to the workers: a newline would end the header early.
    with pytest.raises(ValueError, match="control characters"):
        HttpWorkerClient(api_key=key)
