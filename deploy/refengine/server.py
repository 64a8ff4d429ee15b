"""The reference engine's HTTP API: SGLang's subset and PD fields, plus the bootstrap server.

Main port: `/generate`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE), `/v1/models`,
`/health`, `/health_generate`, `/ping`, `/server_info` (and `/get_server_info`), `/get_model_info`,
`/metrics`, `/abort_request`. Bootstrap port (prefill): `/kv/claim`, `/kv/cancel`, `/health`.
PD fields come from the body (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`) or from the
`x-override-bootstrap-{host,port,room}` headers, as in sglang (docs/pd-protocol.md).

Where a router can tell, the answers are sglang's, as recorded from a live sglang server
(`tests/support/sglang_recordings/sglang-*-http.json`, checked by `tests/doubles/`): `/health` is a one-token
generation answered on a 1 s tick, error bodies have sglang's two shapes (flat
`{"object": "error", ...}` on the OpenAI routes, `{"error": {"message"}}` on the native ones).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from sglang_pd.deploy.common.contract import DEFAULT_BOOTSTRAP_PORT, ENV_WORKER_API_KEY, WORKER_AUTH_HEADER
from sglang_pd.deploy.common.openai_errors import error_dict

from .chat import template_messages
from .engine import Bootstrap, RefEngine, RequestContext, RequestFailed, SamplingParams, StepOutput
from .pd import Claim, ClaimRejected
from .scheduler import QueueFull

__all__ = ["create_app", "create_bootstrap_app"]

Kind = str  # "generate" | "completion" | "chat"


# sglang's OpenAI routes name the error type by class (`serving_base.create_error_response`).
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 499: "BadRequestError"}


def sglang_error(path: str, status: int, message: str, param: str | None = None) -> Response:
    """An error as sglang answers it on `path`: its OpenAI routes' flat body (`param` naming the
    field at fault, if any), else its native routes' `{"error": {"message"}}`
    (`http_server._create_error_response`)."""
    if path.startswith("/v1/"):
        kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
        body: dict[str, Any] = {"object": "error", "message": message, "type": kind, "param": param, "code": status}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def sglang_abort(status: int, message: str) -> Response:
    """A request the scheduler aborted with a status (the queue is full), unary: sglang raises an
    HTTPException, which its handler answers flat with the status as the type on every route
    (`http_server.validation_exception_handler`)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def sglang_abort_stream(kind: Kind, rid: str, status: int, message: str) -> Response:
    """The same abort on a stream: sglang has answered 200 already, and its first event says it. The
    OpenAI routes send `create_streaming_error_response` (the status's name as the type); `/generate`
    sends the output with the abort as its finish reason."""
    if kind == "generate":
        reason = {"type": "abort", "status_code": status, "message": message}
        event: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}}
    else:
        name = HTTPStatus(status).name
        event = {"error": {"object": "error", "message": message, "type": name, "param": None, "code": status}}
    return Response(_sse(event) + b"data: [DONE]\n\n", media_type="text/event-stream")


def _bootstrap(body: dict[str, Any], request: Request, own_port: int | None) -> Bootstrap | None:
    """The request's bootstrap fields; a null port is this engine's own `--bootstrap-port`, as
    sglang's scheduler takes its `--disaggregation-bootstrap-port` (`handle_generate_request`)."""
    h = request.headers
    host = h.get("x-override-bootstrap-host") or body.get("bootstrap_host")
    port = h.get("x-override-bootstrap-port") or body.get("bootstrap_port")
    room = h.get("x-override-bootstrap-room") or body.get("bootstrap_room")
    if host is None or room is None:
        return None
    if isinstance(room, list) or isinstance(host, list):
        raise RequestFailed(
            "Batch requests (a list of bootstrap rooms) are not supported by the reference engine.", 400
        )
    return Bootstrap(str(host), int(port or own_port or DEFAULT_BOOTSTRAP_PORT), int(room))


def _stop_list(v: Any) -> list[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else [str(s) for s in v]


def _or(v: Any, default: float) -> Any:
    return default if v is None else v


def _sampling_source(body: dict[str, Any], kind: Kind) -> dict[str, Any]:
    src = body.get("sampling_params") or {} if kind == "generate" else body
    if not isinstance(src, dict):
        raise RequestFailed("'sampling_params' must be an object.", 400)
    return src


def _asked_max_tokens(body: dict[str, Any], kind: Kind) -> Any:
    """The request's token limit, None when it sets none."""
    src = _sampling_source(body, kind)
    # The first one given wins, 0 included (a falsy 0 must not fall through to the default).
    given = [src.get("max_new_tokens")] if kind == "generate" else []
    given += [src.get("max_completion_tokens"), src.get("max_tokens")]
    return next((v for v in given if v is not None), None)


def _params(body: dict[str, Any], kind: Kind, context_length: int) -> SamplingParams:
    src = _sampling_source(body, kind)
    asked = _asked_max_tokens(body, kind)
    try:
        max_new = (16 if kind != "chat" else 128) if asked is None else asked
        # sglang's /generate names it `sampling_seed`; its OpenAI routes take OpenAI's `seed`.
        seed = src.get("sampling_seed" if kind == "generate" else "seed")
        p = SamplingParams(
            max_new_tokens=int(max_new),
            temperature=float(_or(src.get("temperature"), 1.0)),
            top_p=float(_or(src.get("top_p"), 1.0)),
            top_k=int(_or(src.get("top_k"), -1)),
            stop=_stop_list(src.get("stop")),
            stop_token_ids=[int(t) for t in src.get("stop_token_ids") or []],
            ignore_eos=bool(src.get("ignore_eos", False)),
            seed=None if seed is None else int(seed),
        )
    except (TypeError, ValueError) as exc:
        raise RequestFailed(f"Invalid sampling parameters: {exc}.", 400) from exc
    if p.max_new_tokens < 1:
        raise RequestFailed(f"max_tokens has value {p.max_new_tokens}; it must be at least 1.", 400)
    if kind == "chat" and asked is not None and p.max_new_tokens > context_length:
        # sglang's chat check (`OpenAIServingChat._validate_request`), in its words (no space after
        # the first sentence: sglang joins its two f-strings without one)
        raise RequestFailed(
            f"max_completion_tokens is too large: {p.max_new_tokens}."
            f"This model supports at most {context_length} completion tokens.",
            400,
        )
    if not 0 < p.top_p <= 1:
        raise RequestFailed(f"top_p has value {p.top_p}; it must be in (0, 1].", 400)
    if not 0 <= p.temperature < float("inf"):
        raise RequestFailed(f"temperature has value {p.temperature}; it must be a finite number >= 0.", 400)
    if body.get("n", 1) not in (1, None):
        raise RequestFailed("n > 1 is not supported by the reference engine; send n=1.", 400)
    if kind != "generate":
        _refuse_unsupported(body)
    return p


# OpenAI fields sglang honours but the reference engine does not: refused with a 400 naming the
# field, rather than silently answered as if they were not there. (field, is it asked for?)
_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("logprobs", lambda v: bool(v)),
    ("top_logprobs", lambda v: bool(v)),
    ("tools", lambda v: bool(v)),
    ("tool_choice", lambda v: v not in (None, "none", "auto")),
    ("response_format", lambda v: isinstance(v, dict) and v.get("type") not in (None, "text")),
    ("echo", lambda v: bool(v)),
    ("suffix", lambda v: bool(v)),
    ("best_of", lambda v: v not in (None, 1)),
    ("logit_bias", lambda v: bool(v)),
)


class UnsupportedParameter(RequestFailed):
    """An OpenAI field the reference engine does not implement (a 400 naming it)."""

    def __init__(self, param: str) -> None:
        super().__init__(f"'{param}' is not supported by the reference engine (sglang supports it); leave it out.", 400)
        self.param = param


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, asked in _UNSUPPORTED:
        if asked(body.get(name)):
            raise UnsupportedParameter(name)


def _prompt_ids(engine: RefEngine, body: dict[str, Any], kind: Kind) -> list[int]:
    tok = engine.tokenizer
    if kind == "chat":
        messages = template_messages(body.get("messages"))
        # sglang's `continue_final_message`: the answer goes on from the last (assistant) message.
        continue_final = bool(body.get("continue_final_message")) and messages[-1]["role"] == "assistant"
        try:
            prompt = tok.apply_chat_template(messages, continue_final=continue_final)
        except ValueError as exc:  # messages the template cannot render: a 400 in sglang too
            raise RequestFailed(str(exc), 400) from exc
        return tok.encode(prompt)
    if kind == "generate" and body.get("input_ids") is not None:
        return _checked_input_ids(body["input_ids"], engine.model.vocab_size)
    text = body.get("text") if kind == "generate" else body.get("prompt")
    if kind == "completion" and isinstance(text, list) and text and all(type(i) is int for i in text):
        return _checked_input_ids(text, engine.model.vocab_size)  # a prompt of token ids, as sglang takes
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        field = "text" if kind == "generate" else "prompt"
        raise RequestFailed(f"'{field}' must be a string (batches are not supported by the reference engine).", 400)
    return tok.encode(text)


def _checked_input_ids(ids: Any, vocab_size: int) -> list[int]:
    """`input_ids` as token ids of the model: an id outside the vocabulary is a 400, not an
    IndexError in the embedding."""
    if not isinstance(ids, list) or any(isinstance(i, list) for i in ids):
        raise RequestFailed("'input_ids' must be one list of token ids (batches are not supported).", 400)
    for at, i in enumerate(ids):
        if isinstance(i, bool) or not isinstance(i, int):
            raise RequestFailed(f"input_ids[{at}] has value {json.dumps(i)}; token ids must be integers.", 400)
        if not 0 <= i < vocab_size:
            raise RequestFailed(
                f"input_ids[{at}] has value {i}, outside the vocabulary: the model has {vocab_size} tokens, "
                f"so ids must be in [0, {vocab_size}).",
                400,
            )
    return list(ids)


class _Formatter:
    """Turns steps into SGLang-native or OpenAI response objects."""

    def __init__(self, engine: RefEngine, kind: Kind, rid: str, prompt_tokens: int, body: dict[str, Any]) -> None:
        self.kind, self.rid, self.prompt_tokens = kind, rid, prompt_tokens
        self.model = str(body.get("model") or engine.config.served_name)
        self.created = int(time.time())
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))
        # sglang's `continuous_usage_stats`: every chunk carries the usage so far.
        self.continuous_usage = bool(options.get("continuous_usage_stats"))
        # sglang's `return_token_ids` on /v1/completions: each choice carries its new token ids,
        # the first one the prompt's too (`serving_completions.py`).
        self.return_token_ids = kind == "completion" and bool(body.get("return_token_ids"))
        self.sent_ids = 0
        self.text = ""
        self.ids: list[int] = []
        self.finish: dict[str, Any] | None = None
        self.t0 = time.perf_counter()
        # sglang's `return_prompt_token_ids` (GenerateReqInput): each answer also carries the
        # prompt's token ids, as `prompt_token_ids` (tokenizer_manager.py); the router asks for it to
        # migrate a text prompt's stream.
        self.prompt_ids: list[int] | None = None
        self.times: dict[str, float] = {}  # the scheduler's times (engine.RequestContext.times)

    def add(self, step: StepOutput) -> None:
        self.text += step.text
        if step.token_id is not None:
            self.ids.append(step.token_id)
        if step.finish_reason is not None:
            self.finish = step.finish_reason

    def _openai_finish(self) -> str | None:
        if self.finish is None:
            return None
        # OpenAI's values only: an aborted answer was cut short, which OpenAI calls "length"
        # (the router maps sglang's "abort" the same way; see deploy/router/pd/relay.py).
        return {"length": "length", "stop": "stop", "abort": "length"}.get(self.finish["type"], "stop")

    def usage(self) -> dict[str, int]:
        n = len(self.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - self.t0,
            **self.times,
        }

    def full(self) -> dict[str, Any]:
        if self.kind == "generate":
            return self._with_prompt_ids({"text": self.text, "output_ids": self.ids, "meta_info": self.meta()})
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": self.text, "logprobs": None}
            if self.return_token_ids:
                choice.update(token_ids=list(self.ids), prompt_token_ids=self.prompt_ids)
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None}
            obj = "chat.completion"
        choice["finish_reason"] = self._openai_finish()
        choice["matched_stop"] = (self.finish or {}).get("matched")
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def _with_prompt_ids(self, out: dict[str, Any]) -> dict[str, Any]:
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def chunk(self, step: StepOutput, first: bool) -> list[dict[str, Any]]:
        if self.kind == "generate":
            return [self._with_prompt_ids({"text": self.text, "output_ids": list(self.ids), "meta_info": self.meta()})]
        out = []
        if self.kind == "chat":
            base = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
            if first:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                out.append({**base, "choices": [role]})
            if step.text or step.finish_reason is None:
                out.append({**base, "choices": [{"index": 0, "delta": {"content": step.text}, "finish_reason": None}]})
            if step.finish_reason is not None:
                out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": self._openai_finish()}]})
        else:
            base = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}
            choice = {"index": 0, "text": step.text, "logprobs": None, "finish_reason": self._openai_finish()}
            if self.return_token_ids:
                choice["token_ids"], self.sent_ids = self.ids[self.sent_ids :], len(self.ids)
                if first:
                    choice["prompt_token_ids"] = self.prompt_ids
            out.append({**base, "choices": [choice]})
        if self.continuous_usage:
            for c in out:
                c["usage"] = self.usage()
        if step.finish_reason is not None and self.include_usage:
            out.append({**base, "choices": [], "usage": self.usage()})
        return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _until_disconnect(request: Request, work: Awaitable[Any], ctx: RequestContext) -> Any:
    """Await `work`; a client that goes away aborts the request (pages are freed by its own cleanup)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                ctx.aborted.set()
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


class WorkerKeyMiddleware:
    """Every route needs `Authorization: Bearer <worker key>` (401 otherwise), /health included:
    an engine's routes (`/abort_request` with `abort_all`, `/kv/claim`) act on other users'
    requests, so only the router and the peer engine may call them. (sglang leaves `/health*`,
    `/ready` and `/metrics` open, `srt/utils/auth.py`; the router sends the key to all of them.)
    The refusal is sglang's own body."""

    def __init__(self, app: ASGIApp, *, key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + key.encode()
        self.denied = b'{"error":"Unauthorized"}'

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            sent = next((v for k, v in scope["headers"] if k == WORKER_AUTH_HEADER.encode()), b"")
            if not hmac.compare_digest(sent, self.expected):
                await Response(self.denied, status_code=401, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guard(app: FastAPI, api_key: str | None) -> FastAPI:
    key = os.environ.get(ENV_WORKER_API_KEY, "") if api_key is None else api_key
    if key:
        app.add_middleware(WorkerKeyMiddleware, key=key)
    return app


async def _one_token(engine: RefEngine) -> None:
    """The health check's generation: one greedy token of a one-token prompt, on the model thread."""
    ctx = engine.begin(f"HEALTH_CHECK_{uuid.uuid4().hex}")
    try:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        async for _ in engine.generate(ctx, engine.tokenizer.encode("ok")[:1], params, None):
            pass
    except RequestFailed:
        # Counted like any other step: the check looks at the model thread, not this answer. A
        # full engine queues the probe (or refuses it): the steps of the requests it runs answer.
        pass
    finally:
        engine.end(ctx)


def _left(app: FastAPI) -> None:
    """A client that leaves while its body is read (the connection limits cut one whose body stops
    coming, with 408, and log it once) ends its request quietly: no traceback per connection."""

    @app.exception_handler(ClientDisconnect)
    async def _client_left(_request: Request, _exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # never sent: the connection is gone


def create_app(engine: RefEngine, *, api_key: str | None = None) -> FastAPI:
    """The engine's HTTP API; `api_key` (default: $SGLANG_PD_WORKER_API_KEY) guards every route."""
    app = FastAPI(title="sglang-pd reference engine", docs_url=None, redoc_url=None)
    _guard(app, api_key)
    _left(app)

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, exc: RequestFailed) -> Response:
        if isinstance(exc, QueueFull):
            return sglang_abort(exc.status, str(exc))
        return sglang_error(request.url.path, exc.status, str(exc), getattr(exc, "param", None))

    async def serve(request: Request, kind: Kind) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return sglang_error(request.url.path, 400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return sglang_error(request.url.path, 400, "The request body must be a JSON object.")
        bootstrap = _bootstrap(body, request, engine.config.bootstrap_port)
        params = _params(body, kind, engine.context_length)
        ids = _prompt_ids(engine, body, kind)
        if _asked_max_tokens(body, kind) is None:
            # sglang caps a request that sets no limit at what the context has left, and serves it
            params.max_new_tokens = max(1, min(params.max_new_tokens, engine.context_length - len(ids)))
        rid = str(body.get("rid") or request.headers.get("x-request-id") or uuid.uuid4().hex)
        prefix = {"generate": "", "completion": "cmpl-", "chat": "chatcmpl-"}[kind]
        fmt = _Formatter(engine, kind, prefix + rid if not rid.startswith(prefix) else rid, len(ids), body)
        if (kind == "generate" and body.get("return_prompt_token_ids")) or fmt.return_token_ids:
            fmt.prompt_ids = list(ids)
        stream = bool(body.get("stream", False))
        ctx = engine.begin(rid)
        handed_off = False  # once the stream owns the request, it ends it
        try:
            if engine.config.role == "prefill" and bootstrap is not None:
                # The prefill leg: its answer only matters to the router when it fails.
                step = await _until_disconnect(request, engine.prefill_and_send(ctx, ids, params, bootstrap), ctx)
                fmt.add(step)
                fmt.times = ctx.times
                if not stream:
                    return JSONResponse(fmt.full())
                payload = b"".join(_sse(c) for c in fmt.chunk(step, True)) + b"data: [DONE]\n\n"
                return Response(payload, media_type="text/event-stream")
            gen = engine.generate(ctx, ids, params, bootstrap)
            if not stream:

                async def collect() -> None:
                    async for step in gen:
                        fmt.add(step)

                await _until_disconnect(request, collect(), ctx)
                if fmt.finish and fmt.finish["type"] == "abort":
                    return sglang_error(request.url.path, 499, f"Request {rid} was aborted.")
                return JSONResponse(fmt.full())
            # Start the work before answering 200, so that a failed handshake is a clean 5xx.
            try:
                first = await _until_disconnect(request, gen.__anext__(), ctx)
            except QueueFull as exc:
                await gen.aclose()
                return sglang_abort_stream(kind, fmt.rid, exc.status, str(exc))
            except BaseException:
                await gen.aclose()
                raise
            handed_off = True
        finally:
            if not handed_off:
                engine.end(ctx)

        async def events() -> AsyncIterator[bytes]:
            try:
                step, is_first = first, True
                while True:
                    fmt.add(step)
                    for c in fmt.chunk(step, is_first):
                        yield _sse(c)
                    is_first = False
                    if step.finish_reason is not None:
                        break
                    try:
                        step = await gen.__anext__()
                    except RequestFailed as exc:
                        yield _sse(error_dict(exc.status, str(exc)))
                        break
                yield b"data: [DONE]\n\n"
            finally:
                ctx.aborted.set()
                await gen.aclose()
                engine.end(ctx)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await serve(request, "generate")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        # As sglang's `health_generate`: submit a one-token generation, then look every tick for any
        # step of the model since the check began (a busy engine passes at the first tick); 503
        # when nothing ran within the timeout. PD engines probe themselves without a peer.
        began = time.monotonic()
        probe = asyncio.ensure_future(_one_token(engine))
        try:
            while time.monotonic() - began < engine.config.health_timeout_s:
                await asyncio.sleep(engine.config.health_tick_s)
                if engine.last_step_at > began:
                    return Response(status_code=200)
            return Response(status_code=503)
        finally:
            probe.cancel()

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = engine.config.served_name
        card = {"id": name, "object": "model", "created": int(engine.started), "owned_by": "sglang", "root": name}
        card.update(parent=None, max_model_len=engine.context_length)
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model.name,
            "tokenizer_path": engine.model.name,
            "is_generation": True,
            "served_model_name": engine.config.served_name,
            "weights_digest": engine.model.weights_digest,
        }

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        running = engine.scheduler.running
        return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": engine.waiting}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        # sglang answers 200 with no body, also for an id it does not know.
        body = await request.json()
        engine.abort(None if body.get("abort_all") else str(body.get("rid") or ""))
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return Response(status_code=200)

    return app


def create_bootstrap_app(engine: RefEngine, *, api_key: str | None = None) -> FastAPI:
    """The prefill's bootstrap API (the decode's KV claims), guarded like `create_app`."""
    app = FastAPI(title="sglang-pd reference engine bootstrap", docs_url=None, redoc_url=None)
    _guard(app, api_key)
    _left(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/kv/claim")
    async def claim(request: Request) -> Response:
        try:
            c = Claim.from_json(await request.json())
        except (KeyError, TypeError, ValueError) as exc:
            return JSONResponse({"error": f"Malformed claim: {exc}."}, status_code=400)
        try:
            return JSONResponse(await engine.serve_claim(c))
        except ClaimRejected as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/kv/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        body = await request.json()
        await engine.cancel_claim(int(body["room"]))
        return {"ok": True}

    return app
