"""Protocol-faithful PD test workers for the router's tests and benchmark (no model).

`FakeWorker` follows the PD protocol (docs/pd-protocol.md) as far as a router can tell:
- prefill and decode take the same body on `/generate`, `/v1/completions`, `/v1/chat/completions`
  and refuse it (400) without `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (lists for a
  batch `/generate`); a prefill also checks that the port is its own bootstrap port and that a
  `routed_dp_rank` agrees with `bootstrap_room % dp_size`;
- the decode fetches the request's KV hand-off from the prefill at `bootstrap_host:bootstrap_port`
  by room before it emits a token, so a router that sends the legs inconsistently (or a dead
  prefill) stalls the decode exactly as with sglang;
- decode answers (SSE in OpenAI's chunk format when streaming), prefill answers with the input
  logprobs when asked; `/abort_request` stops a request;
- `/health` and `/health_generate` answer as sglang's one handler `health_generate` does
  (`srt/entrypoints/http_server.py`): 503 for the first `starting_s` seconds (sglang's
  `ServerStatus.Starting`); otherwise the probe checks every `health_tick_s` (sglang: 1 s) whether
  the engine produced output, 200 at the first check where it did, 503 after `health_timeout_s`
  (sglang's `SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s) of none. The engine produces output unless
  `frozen` (its scheduler stopped while HTTP stays up: requests stall too). `health_status` /
  `health_delay` replace that with a fixed answer after a fixed delay;
- `/v1/models` (sglang's model card fields), `/get_model_info` and `/model_info`, `/ping` answer at
  once, as sglang's HTTP process answers them alone; `models_status` / `models_delay` make
  `/v1/models` fail or lag;
- `/server_info` reports the DP layout as `sglang_version` does: "0.5.23" (the default) as
  `dp_size=1, attn_dp_size=N` (`--attn-dp-size N`), "0.5.17" as `dp_size=N` with
  `enable_dp_attention`.

It runs two ways. In process (`InProcessCluster`): the router's `WorkerClient` calls the workers
directly, the decode reaches the prefill's hand-off through the cluster, and a test reads and
changes a worker's state as attributes. As a process (`start_workers`, real HTTP on loopback,
`router_worker_server.py`): for tests that need real processes (SIGKILL mid-request, a router
started from its CLI) and for the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sglang_pd.deploy.common.contract import Role
from sglang_pd.deploy.common.openai_errors import error_body
from sglang_pd.deploy.router.api.validation import ENDPOINTS, batch_size
from sglang_pd.deploy.router.exceptions import UpstreamTimeout, UpstreamUnreachable
from sglang_pd.deploy.router.transport.client import Purpose, Timeouts, WorkerClient
from sglang_pd.deploy.router.workers.registry import Worker

__all__ = ["SGLANG_VERSIONS", "FakeReply", "FakeWorker", "InProcessClient", "InProcessCluster"]

# The sglang releases whose /server_info layout the worker can report.
SGLANG_VERSIONS = ("0.5.17", "0.5.23")

_SEEN_HEADERS = (
    "authorization",
    "x-request-id",
    "connection",
    "x-client-secret",
    "cookie",
    "te",
    "upgrade",
    "traceparent",
    "tracestate",
)
_MAX_TOKENS = 512  # a fake engine has no context limit; this keeps fuzzed requests short
_CONTEXT_LEN = 4096  # what /v1/models and /server_info report (the fake itself has no limit)
# Settings `configure()` may change.
_SETTINGS = frozenset(
    {
        "fail_status", "fail_count", "token_delay", "prefill_delay", "tokens", "keep_log", "health_status",
        "health_delay", "health_tick_s", "health_timeout_s", "starting_s", "frozen", "models_status", "models_delay",
        "done_delay",
    }
)  # fmt: skip
SSE = "text/event-stream"
JSON = "application/json"

# (bootstrap host, bootstrap port, room) -> None, or why the KV hand-off failed.
FetchKV = Callable[[str, int, int], Awaitable[str | None]]


@dataclass
class FakeReply:
    status: int
    content_type: str = JSON
    body: bytes | AsyncIterator[bytes] = b""


def _json(obj: Any, status: int = 200) -> FakeReply:
    return FakeReply(status, JSON, json.dumps(obj).encode())


def _err(status: int, message: str) -> FakeReply:
    return FakeReply(status, JSON, error_body(status, message))


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _as_list(value: Any, n: int | None) -> list[Any]:
    return value if n is not None and isinstance(value, list) else [value]


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(key), int):
            return int(body[key])
    params = body.get("sampling_params")
    if isinstance(params, dict) and isinstance(params.get("max_new_tokens"), int):
        return int(params["max_new_tokens"])
    return default


def _prompt_len(body: dict[str, Any]) -> int:
    if isinstance(body.get("messages"), list):
        return sum(len(str(m.get("content", "")).split()) + 4 for m in body["messages"] if isinstance(m, dict))
    for key in ("prompt", "text", "input_ids"):
        value = body.get(key)
        if isinstance(value, str):
            return max(1, len(value.split()))
        if isinstance(value, list):
            return max(1, len(value))
    return 1


def _check_input(path: str, body: dict[str, Any]) -> str | None:
    if path == "/v1/chat/completions" and not (isinstance(body.get("messages"), list) and body["messages"]):
        return "messages must be a non-empty list"
    if path == "/v1/completions" and "prompt" not in body:
        return "prompt is required"
    if path == "/generate" and "text" not in body and "input_ids" not in body:
        return "text or input_ids is required"
    return None


def _choice(path: str, text: str, finish: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
    if path != "/v1/chat/completions":
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if delta:
        content: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}


def _openai(path: str, rid: str, model: str, choices: list[Any], *, chunk: bool, usage: Any = None) -> Any:
    kind = "chat.completion" if path == "/v1/chat/completions" else "text_completion"
    obj: dict[str, Any] = {
        "id": rid,
        "object": kind + ".chunk" if chunk and kind == "chat.completion" else kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = usage
    return obj


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _generate_meta(rid: str, prompt: int, completion: int, finish: str, logprobs: bool, role: str) -> Any:
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "finish_reason": {"type": finish},
    }
    if logprobs:
        # sglang's convention: prefill reports the prompt's logprobs, decode only its own part.
        meta["input_token_logprobs"] = [[-0.5, i, None] for i in range(prompt)] if role == "prefill" else []
        meta["output_token_logprobs"] = [[-0.1, 100 + i, None] for i in range(completion)]
    return meta


@dataclass(eq=False)
class FakeWorker:
    """One test worker's behaviour and state, independent of how requests reach it."""

    role: Role
    fetch_kv: FetchKV | None = None  # decode: how to reach a prefill's hand-off
    url: str = ""  # where the router reaches it
    model: str = "test-model"
    dp_size: int = 1
    bootstrap_port: int = 0
    tokens: int = 8
    token_delay: float = 0.0
    prefill_delay: float = 0.0
    # A stream's body ends this long after its `data: [DONE]` (the chunked terminator can reach
    # the router after the client already read [DONE] and hung up).
    done_delay: float = 0.0
    # The capacity /server_info reports (sglang's max_running_requests, max_total_num_tokens).
    max_running_requests: int = 64
    max_total_num_tokens: int = 1 << 20
    handshake_timeout: float = 10.0
    keep_log: bool = True
    # Failure injection: the next `fail_count` requests get `fail_status` (500 when 0).
    fail_status: int = 0
    fail_count: int = 0
    # /health as sglang's health_generate (see the module docstring); `health_checks` counts the
    # probes. `health_status` / `health_delay`, when set, make it a fixed answer instead.
    health_tick_s: float = 1.0
    health_timeout_s: float = 20.0
    starting_s: float = 0.0
    frozen: bool = False
    health_status: int | None = None
    health_delay: float | None = None
    health_checks: int = 0
    health_in_flight_max: int = 0
    _health_in_flight: int = 0
    # /v1/models answers `models_status` after `models_delay` s; `models_checks` counts them.
    models_status: int = 200
    models_delay: float = 0.0
    models_checks: int = 0
    models_in_flight_max: int = 0
    _models_in_flight: int = 0
    sglang_version: str = "0.5.23"
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    in_flight: int = 0
    _aborted: set[str] = field(default_factory=set)
    _rooms: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _room_times: dict[int, float] = field(default_factory=dict)
    _started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.sglang_version not in SGLANG_VERSIONS:
            raise ValueError(f"FakeWorker sglang_version {self.sglang_version!r}: use one of {SGLANG_VERSIONS}.")

    def configure(self, **changes: Any) -> None:
        """Change behaviour (`_SETTINGS`: fail_status, token_delay, frozen, ...); `reset=True`
        clears the log."""
        if changes.pop("reset", False):
            self.requests.clear()
            self.aborts.clear()
        for key, value in changes.items():
            if key not in _SETTINGS:
                raise ValueError(f"FakeWorker has no setting {key!r}.")
            setattr(self, key, value)

    def state(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "aborts": self.aborts,
            "in_flight": self.in_flight,
            "health_checks": self.health_checks,
            "health_in_flight_max": self.health_in_flight_max,
            "models_checks": self.models_checks,
            "models_in_flight_max": self.models_in_flight_max,
        }

    # -- the HTTP API --------------------------------------------------------------------------

    async def handle(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> FakeReply:
        if method == "POST" and path in ENDPOINTS:
            return await self._inference(path, headers, raw)
        if method == "POST" and path == "/abort_request":
            rid = str(json.loads(raw).get("rid", ""))
            self.aborts.append(rid)
            self._aborted.add(rid)
            return _json({"success": True})
        if method == "POST" and path == "/flush_cache":
            return _json({"success": True})
        if method != "GET":
            return _err(405, f"{method} {path} is not allowed")
        if path in ("/health", "/health_generate"):
            return await self._health()
        if path in ("/server_info", "/get_server_info"):
            return _json(self.server_info())
        if path in ("/get_model_info", "/model_info"):
            return _json({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True})
        if path == "/v1/models":
            return await self._models()
        if path == "/ping":
            return FakeReply(200, "text/plain")
        if path == "/v1/loads":
            return _json({"loads": [{"dp_rank": 0, "num_reqs": self.in_flight}]})
        if path == "/metrics":
            return FakeReply(200, "text/plain", f"sglang:num_running_reqs {self.in_flight}\n".encode())
        return _err(404, f"no route {path}")

    async def _health(self) -> FakeReply:
        self.health_checks += 1
        self._health_in_flight += 1
        self.health_in_flight_max = max(self.health_in_flight_max, self._health_in_flight)
        try:
            return FakeReply(await self._health_generate(), "text/plain")
        finally:
            self._health_in_flight -= 1

    async def _health_generate(self) -> int:
        """The status sglang's health_generate would answer (see the module docstring)."""
        if self.health_status is not None or self.health_delay is not None:
            await asyncio.sleep(self.health_delay or 0.0)
            return 200 if self.health_status is None else self.health_status
        if time.monotonic() - self._started < self.starting_s:
            return 503
        tic = time.monotonic()
        while True:
            # sglang sleeps a tick before its first look, so a pass takes one tick at least.
            await asyncio.sleep(max(self.health_tick_s, 0.01) if self.frozen else self.health_tick_s)
            if not self.frozen:
                return 200
            if time.monotonic() - tic >= self.health_timeout_s:
                return 503

    async def _models(self) -> FakeReply:
        self.models_checks += 1
        self._models_in_flight += 1
        self.models_in_flight_max = max(self.models_in_flight_max, self._models_in_flight)
        try:
            if self.models_delay:
                await asyncio.sleep(self.models_delay)
        finally:
            self._models_in_flight -= 1
        if self.models_status != 200:
            return _err(self.models_status, "injected failure")
        created = int(time.time())
        card = {"id": self.model, "object": "model", "created": created, "owned_by": "sglang", "root": self.model,
                "parent": None, "max_model_len": _CONTEXT_LEN}  # fmt: skip
        return _json({"object": "list", "data": [card]})

    async def _scheduler_step(self) -> None:
        """One step of the engine's scheduler: waits while it is frozen."""
        while self.frozen:
            await asyncio.sleep(0.01)

    def server_info(self) -> dict[str, Any]:
        if self.sglang_version == "0.5.17":
            layout: dict[str, Any] = {"dp_size": self.dp_size, "enable_dp_attention": self.dp_size > 1}
        else:  # resolved_dict() reports the deprecated enable_dp_attention as attn_dp_size > 1
            layout = {"dp_size": 1, "attn_dp_size": self.dp_size, "enable_dp_attention": self.dp_size > 1}
        return {
            "model_path": self.model,
            "served_model_name": self.model,
            "disaggregation_mode": self.role,
            **layout,
            "tp_size": 1,
            "max_running_requests": self.max_running_requests,
            "max_total_num_tokens": self.max_total_num_tokens,
            "context_length": _CONTEXT_LEN,
            "page_size": 16,
            "chunked_prefill_size": 8192,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "internal_states": [{"dp_rank": rank} for rank in range(self.dp_size)],
            "version": self.sglang_version,
        }

    async def _inference(self, path: str, headers: dict[str, str], raw: bytes) -> FakeReply:
        try:
            body = json.loads(raw)
        except ValueError:
            return _err(400, "invalid JSON")
        if not isinstance(body, dict):
            return _err(400, "body must be an object")
        problem = _check_input(path, body) or self._check_bootstrap(path, body)
        if problem:
            return _err(400, problem)
        if self.fail_count > 0:
            self.fail_count -= 1
            return _err(self.fail_status or 500, "injected failure")
        n = batch_size(path, body)
        if self.keep_log:
            self.requests.append(
                {
                    "path": path,
                    "rid": body.get("rid"),
                    "room": body["bootstrap_room"],
                    "host": body["bootstrap_host"],
                    "port": body["bootstrap_port"],
                    "routed_dp_rank": body.get("routed_dp_rank"),
                    "stream": bool(body.get("stream")),
                    "headers": {k.lower(): v for k, v in headers.items() if k.lower() in _SEEN_HEADERS},
                }
            )
        rids = [str(r) for r in _as_list(body.get("rid") or "", n)]
        if self.role == "prefill":
            self.in_flight += 1
            try:
                return await self._prefill(path, body, n, rids)
            finally:
                self.in_flight -= 1
        return await self._decode(path, body, n, rids)

    def _check_bootstrap(self, path: str, body: dict[str, Any]) -> str | None:
        n = batch_size(path, body)
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if key not in body:
                return f"PD {self.role} worker needs '{key}' in the request (sent by a PD router)."
            if n is not None and (not isinstance(body[key], list) or len(body[key]) != n):
                return f"'{key}' must be a list of {n} for a batch request."
        for room in _as_list(body["bootstrap_room"], n):
            if not isinstance(room, int) or not 0 <= room < 2**63:
                return f"bootstrap_room {room!r} must be an integer in 0..2**63-1."
        if self.role == "prefill":
            for port in _as_list(body["bootstrap_port"], n):
                # null: the engine's own --disaggregation-bootstrap-port (sglang's scheduler)
                if port is not None and port != self.bootstrap_port:
                    return f"bootstrap_port {port} is not this prefill's bootstrap port {self.bootstrap_port}."
            ranks = body.get("routed_dp_rank")
            if ranks is not None:
                for room, rank in zip(_as_list(body["bootstrap_room"], n), _as_list(ranks, n), strict=False):
                    if room % self.dp_size != rank:
                        return f"bootstrap_room {room} % dp_size {self.dp_size} != routed_dp_rank {rank}."
        return None

    # -- prefill ------------------------------------------------------------------------------

    def _room(self, room: int) -> asyncio.Future[dict[str, Any]]:
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
            self._room_times[room] = time.monotonic()
        return fut

    async def _prefill(self, path: str, body: dict[str, Any], n: int | None, rids: list[str]) -> FakeReply:
        if self.prefill_delay:
            await asyncio.sleep(self.prefill_delay)
        await self._scheduler_step()
        prompt = _prompt_len(body)
        aborted = any(r in self._aborted for r in rids)
        if not aborted:
            for room in _as_list(body["bootstrap_room"], n):
                fut = self._room(room)
                if not fut.done():
                    fut.set_result({"input_len": prompt})
        self._forget_old_rooms()
        finish = "abort" if aborted else "length"
        if path == "/generate":
            meta = _generate_meta(rids[0], prompt, 0, finish, bool(body.get("return_logprob")), "prefill")
            one = {"text": "", "meta_info": meta}
            out: Any = [dict(one, index=i) for i in range(n)] if n is not None else one
        else:
            out = _openai(path, rids[0], self.model, [_choice(path, "", finish, False)], chunk=False,
                          usage=_usage(prompt, 0))  # fmt: skip
        if body.get("stream"):
            events = out if isinstance(out, list) else [out]
            return FakeReply(200, SSE, b"".join(_sse(e) for e in events) + b"data: [DONE]\n\n")
        return _json(out)

    async def kv_handoff(self, room: int) -> tuple[int, dict[str, Any]]:
        """The prefill's bootstrap side: wait until `room` was prefilled, then hand it over."""
        fut = self._room(room)
        try:
            async with asyncio.timeout(self.handshake_timeout):
                return 200, await asyncio.shield(fut)
        except TimeoutError:
            return 404, {"error": f"room {room} was never prefilled"}
        finally:
            if fut.done():
                self._rooms.pop(room, None)
                self._room_times.pop(room, None)

    def _forget_old_rooms(self) -> None:
        """Forget rooms no decode came for (the prefill-only side of an aborted request)."""
        cutoff = time.monotonic() - max(30.0, self.handshake_timeout * 2)
        for room, t in list(self._room_times.items()):
            if t < cutoff:
                self._rooms.pop(room, None)
                self._room_times.pop(room, None)

    # -- decode -------------------------------------------------------------------------------

    async def _handshake(self, body: dict[str, Any], n: int | None) -> str | None:
        assert self.fetch_kv is not None, "a decode FakeWorker needs fetch_kv"
        for host, port, room in zip(
            _as_list(body["bootstrap_host"], n),
            _as_list(body["bootstrap_port"], n),
            _as_list(body["bootstrap_room"], n),
            strict=False,
        ):
            own = self.bootstrap_port or 8998  # a null port: this engine's own setting, as in sglang
            failure = await self.fetch_kv(str(host), own if port is None else int(port), int(room))
            if failure:
                return failure
        return None

    async def _decode(self, path: str, body: dict[str, Any], n: int | None, rids: list[str]) -> FakeReply:
        if body.get("stream"):
            # Headers go out first, as sglang's do: a failed hand-off is the stream's first event.
            return FakeReply(200, SSE, self._decode_stream(path, body, n, rids))
        self.in_flight += 1
        try:
            failure = await self._handshake(body, n)
            if failure:
                return _err(500, failure)
            text, produced, finish = "", 0, "length"
            async for piece, _ in self._tokens(body, rids):
                text += piece
                produced += 1
            if any(r in self._aborted for r in rids):
                finish = "abort"
        finally:
            self.in_flight -= 1
        prompt = _prompt_len(body)
        if path == "/generate":
            meta = _generate_meta(rids[0], prompt, produced, finish, bool(body.get("return_logprob")), "decode")
            one = {"text": text, "meta_info": meta}
            return _json([dict(one, index=i) for i in range(n)] if n is not None else one)
        choice = _choice(path, text, finish, False)
        return _json(_openai(path, rids[0], self.model, [choice], chunk=False, usage=_usage(prompt, produced)))

    async def _tokens(self, body: dict[str, Any], rids: list[str]) -> AsyncIterator[tuple[str, bool]]:
        """(piece, last) for each token, until the limit or an abort."""
        total = min(_max_tokens(body, self.tokens), _MAX_TOKENS)
        for i in range(total):
            if any(r in self._aborted for r in rids):
                return
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            await self._scheduler_step()
            yield f" tok{i}", i == total - 1

    async def _decode_stream(
        self, path: str, body: dict[str, Any], n: int | None, rids: list[str]
    ) -> AsyncIterator[bytes]:
        self.in_flight += 1
        try:
            failure = await self._handshake(body, n)
            if failure:
                yield _sse({"error": {"message": failure, "type": "server_error", "param": None, "code": 500}})
                yield b"data: [DONE]\n\n"
                return
            prompt, text, produced = _prompt_len(body), "", 0
            logprobs = bool(body.get("return_logprob"))
            async for piece, last in self._tokens(body, rids):
                text += piece
                produced += 1
                fin = "length" if last else None
                if path == "/generate":
                    meta = _generate_meta(rids[0], prompt, produced, fin or "", logprobs, "decode")
                    yield _sse({"text": text, "index": 0, "meta_info": meta})
                else:
                    choice = _choice(path, piece, fin, True, first=produced == 1)
                    yield _sse(_openai(path, rids[0], self.model, [choice], chunk=True))
            options = body.get("stream_options") or {}
            if path != "/generate" and isinstance(options, dict) and options.get("include_usage"):
                yield _sse(_openai(path, rids[0], self.model, [], chunk=True, usage=_usage(prompt, produced)))
            yield b"data: [DONE]\n\n"
            if self.done_delay:
                await asyncio.sleep(self.done_delay)
        finally:
            self.in_flight -= 1


# -- in process ---------------------------------------------------------------------------------


class InProcessCluster:
    """Workers that live in the test's process, reached through `client()` by a router.

    Worker URLs are `http://prefill-0:30000`, `http://decode-1:30001`, ...; a prefill's
    bootstrap port is 8998 + its index. `kill(worker)` makes it unreachable from then on (open
    streams break at their next chunk), as a dead process would be.
    """

    def __init__(self, n_prefill: int, n_decode: int, **options: Any) -> None:
        self.workers: dict[str, FakeWorker] = {}
        self.prefills: list[FakeWorker] = []
        self.decodes: list[FakeWorker] = []
        self.dead: set[str] = set()
        for i in range(n_prefill):
            self.prefills.append(
                FakeWorker("prefill", url=f"http://prefill-{i}:30000", bootstrap_port=8998 + i, **options)
            )
        for i in range(n_decode):
            self.decodes.append(
                FakeWorker("decode", url=f"http://decode-{i}:30001", fetch_kv=self._fetch_kv, **options)
            )
        self.workers = {w.url: w for w in self.prefills + self.decodes}

    def kill(self, worker: FakeWorker) -> None:
        self.dead.add(worker.url)

    async def _fetch_kv(self, host: str, port: int, room: int) -> str | None:
        for prefill in self.prefills:
            if urlsplit(prefill.url).hostname == host and prefill.bootstrap_port == port:
                if prefill.url in self.dead:
                    return f"KV transfer for room {room} from {host}:{port} failed: the prefill is gone"
                status, _ = await prefill.kv_handoff(room)
                return None if status == 200 else f"KV transfer for room {room} failed: bootstrap answered {status}"
        return f"KV transfer for room {room} failed: no bootstrap server at {host}:{port}"

    def client(self, timeouts: Timeouts | None = None, api_key: str = "") -> InProcessClient:
        return InProcessClient(self, timeouts=timeouts or Timeouts(), api_key=api_key)


class _InProcessBody:
    def __init__(self, cluster: InProcessCluster, worker: Worker, body: bytes | AsyncIterator[bytes], idle_s: float):
        self._cluster = cluster
        self._worker = worker
        self._body = body
        self._idle_s = idle_s

    async def read(self) -> bytes:
        if isinstance(self._body, bytes):
            body, self._body = self._body, b""
            return body
        return b"".join([chunk async for chunk in self._body])

    async def next_chunk(self) -> bytes:
        if self._worker.url in self._cluster.dead:
            raise UpstreamUnreachable(f"streaming from {self._worker.url} failed: connection reset", self._worker)
        if isinstance(self._body, bytes):
            body, self._body = self._body, b""
            return body
        try:
            # Not wait_for (banned in pyproject.toml): it dropped the cancellation of a relay whose
            # client left, and the relay streamed to its end.
            async with asyncio.timeout(self._idle_s):
                return await anext(self._body, b"")
        except TimeoutError as exc:
            raise UpstreamTimeout(f"streaming from {self._worker.url} timed out", self._worker) from exc

    def release(self) -> None:
        pass

    def close(self) -> None:
        # The worker sees the connection close: its stream generator is stopped.
        if not isinstance(self._body, bytes):
            task = asyncio.ensure_future(_close_quietly(self._body))
            _closing.add(task)
            task.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()


async def _close_quietly(body: AsyncIterator[bytes]) -> None:
    with contextlib.suppress(RuntimeError):  # still running a step: it ends on its own
        await body.aclose()  # type: ignore[attr-defined]


class InProcessClient(WorkerClient):
    """The router's transport to an `InProcessCluster`: the same headers, timeouts and error
    mapping as over HTTP (the WorkerClient base class), without sockets."""

    def __init__(self, cluster: InProcessCluster, *, timeouts: Timeouts, api_key: str) -> None:
        super().__init__(timeouts=timeouts, api_key=api_key)
        self.cluster = cluster

    async def _send(
        self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str], purpose: Purpose
    ) -> tuple[int, str, _InProcessBody]:
        target = self.cluster.workers.get(worker.url)
        if target is None or worker.url in self.cluster.dead:
            raise UpstreamUnreachable(f"{method} {path} to {worker.role} worker {worker.url} failed: refused", worker)
        limit = {
            "unary": self.timeouts.request,
            "stream": self.timeouts.stream_idle,
            "health_generate": self.timeouts.health_generate,
        }.get(purpose, self.timeouts.health)
        try:
            async with asyncio.timeout(limit):
                reply = await target.handle(method, path, headers, body)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{method} {path} to {worker.role} worker {worker.url} timed out", worker) from exc
        return reply.status, reply.content_type, _InProcessBody(self.cluster, worker, reply.body, limit)
