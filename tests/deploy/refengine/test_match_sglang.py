"""Every stand-in for sglang answers as real sglang does, where the router or the gate can tell.

The stand-ins are the router tests' `FakeWorker` (tests/support/router_workers.py, as a process) and
the reference engine (deploy/refengine, the embedded default). The oracle is sglang itself:
- `tests/support/sglang_recordings/sglang-0.5.17-http.json`, recorded from live sglang 0.5.17 servers on an H200
  (`scripts/gpu/gpu_pd_check.py` through `scripts/gpu/record_sglang_http.py`);
- `tests/support/sglang_recordings/sglang-0.5.23-http.json`, read from 0.5.23's source, with its DP layouts checked
  against 0.5.23's own argument resolver here.

What is held to them: `/health`'s timing (a generation answered on a 1 s tick, idle or busy) and
failure modes (503 while starting, 503 once the engine produced nothing for the timeout),
`/ping`, the `/v1/models` card, the `/server_info` fields a router reads and their DP layout,
sglang's two error shapes and status codes, and `/abort_request`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scripts.gpu.record_sglang_http import shape
from sglang_pd.deploy.sglang.check import check_with_sglang, sglang_available
from sglang_pd.deploy.spec.topology import PRESETS_DIR, load_topology
from tests.support.paths import SGLANG_RECORDINGS
from tests.support.polling import wait_until
from tests.support.router_worker_server import WorkerProcess, start_worker
from tests.support.standalone_engine import standalone_engine

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

DATA = SGLANG_RECORDINGS
RECORDED = json.loads((DATA / "sglang-0.5.17-http.json").read_text())
SOURCE = json.loads((DATA / "sglang-0.5.23-http.json").read_text())
SINGLE = RECORDED["servers"]["single"]
PRESETS = PRESETS_DIR
# What a 2-core CI machine adds to a 1 s tick: an answer later than this is not sglang's timing.
TICK_SLACK_S = 0.8


def timed_get(url: str, **kwargs: Any) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = httpx.get(url, timeout=30, **kwargs)
    return r, time.perf_counter() - t0


@contextlib.contextmanager
def busy(url: str, path: str, body: dict[str, Any]) -> Iterator[None]:
    """Keep one streamed request running against `url` while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url + path, json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


# --- the stand-ins, as processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refengine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One reference engine serving on its own (sglang's non-PD mode, as the recorded server ran)."""
    with standalone_engine(tmp_path_factory.mktemp("refengine") / "engine.log") as url:
        yield url


@pytest.fixture(scope="module")
def fake_decode() -> Iterator[WorkerProcess]:
    worker = start_worker("decode", tokens=2000, token_delay=0.002)
    yield worker
    worker.stop()


@pytest.fixture(params=["refengine", "fake_decode"])
def double(request: pytest.FixtureRequest) -> str:
    """The base URL of each stand-in in turn."""
    value = request.getfixturevalue(request.param)
    return value if isinstance(value, str) else value.url


# --- /health: a generation on a 1 s tick -----------------------------------------------------------------


def _within_recorded_tick(seconds: float) -> bool:
    recorded = SINGLE["health"]["seconds"] + SINGLE["health_generate"]["seconds"] + SINGLE["health_busy"]["seconds"]
    return min(recorded) - 0.05 <= seconds <= max(recorded) + TICK_SLACK_S


def test_recording_shows_sglangs_tick() -> None:
    """The recording itself says what the stand-ins must copy (so that a re-recording that
    changed it shows up here first)."""
    seconds = SINGLE["health"]["seconds"] + SINGLE["health_busy"]["seconds"]
    assert SINGLE["health"]["statuses"] == [200] and min(seconds) >= 1.0 and max(seconds) < 1.1
    assert set(SINGLE["start"]["statuses_before_ready"]) == {"503"}
    assert SOURCE["health"]["tick_s"] == 1.0 and SOURCE["health"]["starting_status"] == 503


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_health_answers_after_one_tick_when_idle(double: str, path: str) -> None:
    for _ in range(2):
        r, seconds = timed_get(double + path)
        assert r.status_code == 200
        assert _within_recorded_tick(seconds), f"{path} answered in {seconds:.3f} s; sglang takes one 1 s tick"


def test_health_answers_after_one_tick_when_busy(refengine: str) -> None:
    """A busy engine passes at the first tick: any request's step counts (the fake worker's
    engine is never busy on its own: its streams need a prefill peer)."""
    body = {"text": "busy", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}
    with busy(refengine, "/generate", body):
        r, seconds = timed_get(refengine + "/health")
    assert r.status_code == 200 and _within_recorded_tick(seconds), seconds


def test_health_is_503_while_starting() -> None:
    worker = start_worker("decode", starting_s=2.5)
    try:
        assert httpx.get(worker.url + "/health", timeout=30).status_code == 503
        wait_until(lambda: httpx.get(worker.url + "/health", timeout=30).status_code == 200, timeout=10)
    finally:
        worker.stop()


def test_health_is_503_once_the_engine_produced_nothing_for_the_timeout(fake_decode: WorkerProcess) -> None:
    fake_decode.configure(frozen=True, health_timeout_s=2.0)
    try:
        r, seconds = timed_get(fake_decode.url + "/health")
        assert r.status_code == SOURCE["health"]["failed_status"]
        assert 2.0 <= seconds <= 2.0 + 1.0 + TICK_SLACK_S
        assert timed_get(fake_decode.url + "/v1/models")[0].status_code == 200  # HTTP stays up
    finally:
        fake_decode.configure(frozen=False, health_timeout_s=SOURCE["health"]["timeout_s"])


# --- the instant endpoints -----------------------------------------------------------------------------


def test_ping_and_models_answer_at_once_with_sglangs_card(double: str) -> None:
    r, seconds = timed_get(double + "/ping")
    assert r.status_code == SINGLE["ping"]["status"] and seconds < 0.5
    r, seconds = timed_get(double + "/v1/models")
    assert r.status_code == 200 and seconds < 0.5
    assert shape(r.json()) == SINGLE["v1_models"]["shape"]
    assert r.json()["data"][0]["owned_by"] == SINGLE["v1_models"]["body"]["data"][0]["owned_by"]


def test_model_info_has_sglangs_fields(double: str) -> None:
    r = httpx.get(double + "/get_model_info", timeout=10)
    assert r.status_code == 200
    for key in ("model_path", "tokenizer_path", "is_generation"):
        assert type(r.json()[key]).__name__ == type(SINGLE["get_model_info"]["body"][key]).__name__, key


def test_server_info_has_the_fields_a_router_reads(double: str) -> None:
    info = httpx.get(double + "/server_info", timeout=10).json()
    recorded = SINGLE["server_info"]["fields"]
    for key in ("dp_size", "enable_dp_attention", "tp_size", "max_running_requests", "max_total_num_tokens",
                "context_length", "page_size", "disaggregation_mode", "disaggregation_bootstrap_port"):  # fmt: skip
        assert key in info, key
        assert type(info[key]).__name__ == type(recorded[key]).__name__, (key, info[key], recorded[key])
    assert isinstance(info["internal_states"], list) and info["internal_states"]


# --- /server_info's DP layout, per release -----------------------------------------------------------------


@pytest.fixture(scope="module")
def resolved_decode_0523() -> dict[str, Any]:
    """sglang 0.5.23's own resolution of the R1 preset's decode command (`--attn-dp-size 16`)."""
    if not sglang_available():
        pytest.skip("sglang is not installed (the `validate` extra + sglang --no-deps)")
    checks = check_with_sglang(load_topology(PRESETS / "deepseek-r1-h200-1p1d.yaml"))
    decode = next(c for c in checks if c.command.role == "decode")
    assert decode.ok, decode.error
    return decode.resolved


@pytest.mark.sglang
def test_dp_attention_layout_is_0523s(resolved_decode_0523: dict[str, Any]) -> None:
    n = resolved_decode_0523["attn_dp_size"]
    assert n == 16 and resolved_decode_0523["dp_size"] == SOURCE["server_info_layouts"]["attn_dp"]["dp_size"]
    worker = start_worker("decode", dp_size=n, sglang_version="0.5.23")
    try:
        info = httpx.get(worker.url + "/server_info", timeout=10).json()
    finally:
        worker.stop()
    assert (info["dp_size"], info["attn_dp_size"]) == (resolved_decode_0523["dp_size"], n)


def test_dp_attention_layout_is_0517s() -> None:
    want = SOURCE["server_info_layouts_0.5.17"]["attn_dp"]
    worker = start_worker("decode", dp_size=8, sglang_version="0.5.17")
    try:
        info = httpx.get(worker.url + "/server_info", timeout=10).json()
    finally:
        worker.stop()
    assert info["dp_size"] == 8 and info["enable_dp_attention"] is want["enable_dp_attention"]
    assert "attn_dp_size" not in info  # 0.5.17 has no such field (its recorded keys)
    assert "attn_dp_size" not in SINGLE["server_info"]["keys"]


# --- errors and aborts (the reference engine serves requests without a PD peer) ---------------------------


def _shape_of(error: str) -> Any:
    return shape(SINGLE["errors"][error]["body"])


def test_error_bodies_have_sglangs_shapes_and_statuses(refengine: str) -> None:
    errors = SINGLE["errors"]
    r = httpx.get(refengine + "/no_such_endpoint", timeout=10)
    assert r.status_code == errors["unknown_path"]["status"] and shape(r.json()) == _shape_of("unknown_path")
    r = httpx.post(refengine + "/v1/chat/completions", json={"model": "tiny-deepseek-v3"}, timeout=10)
    assert r.status_code == errors["chat_without_messages"]["status"]
    assert shape(r.json()) == _shape_of("chat_without_messages")
    r = httpx.post(refengine + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == errors["chat_malformed_json"]["status"]
    assert shape(r.json()) == _shape_of("chat_malformed_json")
    long_prompt = {"model": "tiny-deepseek-v3", "prompt": "x " * 20000, "max_tokens": 4}
    r = httpx.post(refengine + "/v1/completions", json=long_prompt, timeout=30)
    assert r.status_code == errors["completion_longer_than_context"]["status"]
    assert shape(r.json()) == _shape_of("completion_longer_than_context")
    r = httpx.post(refengine + "/generate", json={"sampling_params": {}}, timeout=10)
    assert r.status_code == errors["generate_without_text"]["status"]
    assert shape(r.json()) == _shape_of("generate_without_text")


def test_abort_request_answers_as_sglang(refengine: str) -> None:
    recorded = SINGLE["abort"]
    r = httpx.post(refengine + "/abort_request", json={"rid": "no-such-rid"}, timeout=10)
    assert (r.status_code, r.text) == (recorded["unknown_rid"]["status"], recorded["unknown_rid"]["body"])
    rid = f"abort-{time.time_ns()}"
    body = {
        "text": "abort me",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    events: list[Any] = []
    with httpx.stream("POST", refengine + "/generate", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    assert httpx.post(refengine + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    want = recorded["stream_aborted_by_rid"]
    assert (events[-1] == "[DONE]") is want["ends_with_done"]
    last = next(e for e in reversed(events) if isinstance(e, dict))
    assert last["meta_info"]["finish_reason"]["type"] == want["last_finish_reason"]["type"] == "abort"
