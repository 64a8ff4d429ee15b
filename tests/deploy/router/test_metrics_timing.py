"""The router's latency metrics mean what they say, and its TTFT breakdown adds up.

- Time to first token comes from streamed first tokens only; a unary answer is no first token.
- End-to-end latency and time per output token carry the outcome; an error answer (the router's
  own 401 / 429 included) is counted under its status and never lands in the `ok` series.
- `x-sglpd-timing: 1` gets a `Server-Timing` header whose parts add up to the TTFT the client
  measured (within 5 %), and a slow prefill, or a slow decode, shows in its own part: in the
  header, in the request's log line and in the per-worker part histograms. The router runs from
  its CLI as a real process, in front of test workers that are real processes too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_pd.deploy.common.procs import Child, spawn
from sglang_pd.deploy.router.metrics import TTFT_PARTS
from tests.support.polling import free_port, wait_until

from .conftest import Cluster

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
NS = "sglang_pd_router_"


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the router's /metrics, by name and label set."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == NS + name and want <= ls)


def test_ttft_is_streamed_only_and_errors_stay_out_of_ok(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1, token_delay=0.01)
    config = cluster.config(api_keys=("k1",), max_concurrent_requests=1, max_queued_requests=0)
    with cluster.serve(config) as running:
        auth = {"authorization": "Bearer k1"}
        with httpx.Client(timeout=10, headers=auth) as client:
            for _ in range(3):
                assert client.post(running.url + CHAT, json=BODY).status_code == 200
            found = samples(running.url)
            assert value(found, "time_to_first_token_seconds_count", endpoint=CHAT) == 0, "unary is no first token"
            assert value(found, "e2e_request_latency_seconds_count", endpoint=CHAT, outcome="ok") == 3

            with client.stream("POST", running.url + CHAT, json={**BODY, "stream": True}) as resp:
                assert resp.status_code == 200
                resp.read()
            # The one admission slot is free once the stream's handler has finished, a moment after
            # the client read [DONE]: wait for it, or the next request is refused for load.
            wait_until(lambda: value(samples(running.url), "active_requests") == 0, timeout=5)
            assert client.post(running.url + CHAT, content=b"not json").status_code == 400
            assert httpx.post(running.url + CHAT, json=BODY, headers={"authorization": "Bearer bad"}).status_code == 401

            async def two_at_once() -> list[int]:
                async with httpx.AsyncClient(timeout=10, headers=auth) as ac:
                    slow = {**BODY, "max_tokens": 30}
                    answers = await asyncio.gather(*[ac.post(running.url + CHAT, json=slow) for _ in range(2)])
                return sorted(r.status_code for r in answers)

            assert asyncio.run(two_at_once()) == [200, 429]

            def streamed_counted() -> bool:  # a stream is recorded once its relay has ended
                return value(samples(running.url), "time_to_first_token_seconds_count", endpoint=CHAT) == 1

            wait_until(streamed_counted)
        found = samples(running.url)
    e2e = "e2e_request_latency_seconds_count"
    assert value(found, e2e, endpoint=CHAT, outcome="ok") == 5  # 3 unary, 1 stream, 1 of the pair
    assert value(found, e2e, endpoint=CHAT, outcome="client_error") == 2  # the 400 and the 401
    assert value(found, e2e, endpoint=CHAT, outcome="rejected") == 1
    for status in ("401", "429", "400"):
        assert value(found, "requests_total", endpoint=CHAT, status=status) == 1, status
    assert value(found, "request_time_per_output_token_seconds_count", endpoint=CHAT, outcome="ok") == 1
    tpot = value(found, "request_time_per_output_token_seconds_sum", endpoint=CHAT, outcome="ok")
    assert 0.005 < tpot < 0.5, tpot  # token_delay 10 ms between the decode's chunks
    assert value(found, "time_to_first_token_part_seconds_count", part="prefill", role="prefill") == 1


def test_upstream_failure_is_upstream_error_not_ok(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(max_retries=0)) as running:
        cluster.decodes[0].configure(fail_status=500, fail_count=1)
        assert httpx.post(running.url + CHAT, json=BODY, timeout=10).status_code == 502
        found = samples(running.url)
    e2e = "e2e_request_latency_seconds_count"
    assert value(found, e2e, endpoint=CHAT, outcome="upstream_error") == 1
    assert value(found, e2e, endpoint=CHAT, outcome="ok") == 0


class CliRouter:
    """`python -m sglang_pd.deploy.router.cli` as a real process, its JSON log in a file."""

    def __init__(self, log: Path, cluster: Cluster) -> None:
        p, d = cluster.prefills[0], cluster.decodes[0]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(self.port),
                "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url, "--health-interval", "0.5",
                "--log-level", "info"]  # fmt: skip
        with log.open("wb") as out:
            self.child: Child = spawn("router", argv, stdout=out, stderr=subprocess.STDOUT, text=False)
        self.child.wait_http(self.url + "/health", timeout_s=30)
        wait_until(lambda: httpx.get(self.url + "/readiness").json().get("decode") == 1, timeout=15)

    def finished(self, router_id: str) -> dict[str, object]:
        def line() -> dict[str, object] | None:
            for raw in self.log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(raw)
                    if entry.get("msg") == "request finished" and entry.get("request_id") == router_id:
                        return dict(entry)
            return None

        wait_until(lambda: line() is not None)
        found = line()
        assert found is not None
        return found


@contextlib.contextmanager
def cli_router(tmp_path: Path, cluster: Cluster) -> Iterator[CliRouter]:
    router = CliRouter(tmp_path / "router.log", cluster)
    try:
        yield router
    finally:
        router.child.stop(grace_s=5)


def timed_stream(url: str) -> tuple[float, dict[str, float], str]:
    """One streamed chat request asking for the breakdown: the TTFT the client measured (request
    sent to first body bytes), the Server-Timing parts in seconds, and the router's request id."""
    with httpx.Client(timeout=30) as client:
        client.get(url + "/health")  # the connection is open before the clock starts
        started = time.perf_counter()
        with client.stream("POST", url + CHAT, json={**BODY, "stream": True}, headers={"x-sglpd-timing": "1"}) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            next(chunks)
            ttft = time.perf_counter() - started
            for _ in chunks:  # the rest of the stream
                pass
    parts = {}
    for entry in r.headers["server-timing"].split(","):
        name, _, dur = entry.strip().partition(";dur=")
        parts[name] = float(dur) / 1000
    return ttft, parts, r.headers["x-router-request-id"]


@pytest.mark.serial  # its parts are held to the client's clock within 5 %
def test_ttft_breakdown_adds_up_and_points_at_the_slow_part(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(1, 1, processes=True, prefill_delay=0.3)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    with cli_router(tmp_path, cluster) as router:
        timed_stream(router.url)  # warm: the router's connections to the workers are open
        ttft, parts, rid = timed_stream(router.url)
        shown = sum(v for k, v in parts.items() if k in TTFT_PARTS)
        assert abs(shown - ttft) / ttft < 0.05, (shown, ttft, parts)
        assert abs(parts["total"] - shown) < 1e-5
        assert parts["prefill"] > 0.8 * ttft, parts
        assert parts["decode"] < 0.1 * ttft, parts
        logged = router.finished(rid)["timing_ms"]
        assert isinstance(logged, dict) and logged["prefill"] > 250, logged

        # The control: the same stack with the delay moved to the decode's first token.
        prefill.configure(prefill_delay=0.0)
        decode.configure(token_delay=0.3)
        ttft, parts, _ = timed_stream(router.url)
        assert parts["decode"] > 0.8 * ttft and parts["prefill"] < 0.1 * ttft, parts

        found = samples(router.url)
        by_prefill = value(found, "time_to_first_token_part_seconds_sum", part="prefill", worker=prefill.url)
        by_decode = value(found, "time_to_first_token_part_seconds_sum", part="decode", worker=decode.url)
        assert by_prefill > 0.55 and by_decode > 0.25, (by_prefill, by_decode)  # two slow prefills, one decode
        assert value(found, "time_to_first_token_seconds_count", endpoint=CHAT) == 3

        # Without the header, no breakdown is sent.
        plain = httpx.post(router.url + CHAT, json=BODY, timeout=30)
        assert plain.status_code == 200 and "server-timing" not in plain.headers
