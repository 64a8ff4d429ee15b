"""A protocol-faithful test worker for the router's tests and benchmark (no model, real HTTP).

It follows SGLang's PD protocol (REFERENCE.md §2) as far as the router can tell:
- prefill and decode take the same body on `/generate`, `/v1/completions`, `/v1/chat/completions`
  and refuse it (400) without `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (lists for a
  batch `/generate`); a prefill also checks that the port is its own bootstrap port and that a
  `routed_dp_rank` agrees with `bootstrap_room % dp_size`;
- the prefill runs a bootstrap server on its bootstrap port; the decode fetches the request's KV
  hand-off from `bootstrap_host:bootstrap_port` by room before it emits a token, so a router that
  sends the legs inconsistently (or a dead prefill) stalls the decode exactly as with sglang;
- decode answers (SSE in OpenAI's chunk format when streaming), prefill answers with the input
  logprobs when asked; `/abort_request` stops a request; `/health`, `/health_generate`,
  `/server_info`, `/get_model_info`, `/v1/models`, `/v1/loads`, `/metrics`, `/flush_cache`.
It also has `/_test/state` (what it saw) and `/_test/config` (inject failures) for tests.

Run one: `python -m sglang_pd.deploy.router.testing --role decode --port 0`; it prints one JSON
line `{"port": ..., "bootstrap_port": ...}` when it is ready. `start_worker()` does that for you.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerProcess", "start_worker", "start_workers"]

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
_SEEN_HEADERS = ("authorization", "x-request-id", "connection", "x-client-secret", "cookie", "te", "upgrade")
_MAX_TOKENS = 512  # a fake engine has no context limit; this keeps fuzzed requests short


@dataclass
class _State:
    role: str
    model: str
    dp_size: int
    bootstrap_port: int
    tokens: int
    token_delay: float
    prefill_delay: float
    handshake_timeout: float
    fail_status: int = 0
    fail_count: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    rooms: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    room_times: dict[int, float] = field(default_factory=dict)
    in_flight: int = 0
    keep_log: bool = True


def _err(status: int, message: str) -> Any:
    from aiohttp import web

    return web.json_response(
        {
            "error": {
                "message": message,
                "type": "BadRequestError" if status < 500 else "InternalServerError",
                "param": None,
                "code": status,
            }
        },
        status=status,
    )


def _as_list(value: Any, n: int | None) -> list[Any]:
    return value if n is not None and isinstance(value, list) else [value]


def _batch(path: str, body: dict[str, Any]) -> int | None:
    if path != "/generate":
        return None
    if isinstance(body.get("text"), list):
        return len(body["text"])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


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


def _check_bootstrap(state: _State, path: str, body: dict[str, Any]) -> str | None:
    n = _batch(path, body)
    for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        if key not in body:
            return f"PD {state.role} worker needs '{key}' in the request (sent by a PD router)."
        if n is not None and (not isinstance(body[key], list) or len(body[key]) != n):
            return f"'{key}' must be a list of {n} for a batch request."
    for room in _as_list(body["bootstrap_room"], n):
        if not isinstance(room, int) or not 0 <= room < 2**63:
            return f"bootstrap_room {room!r} must be an integer in 0..2**63-1."
    if state.role == "prefill":
        for port in _as_list(body["bootstrap_port"], n):
            if port != state.bootstrap_port:
                return f"bootstrap_port {port} is not this prefill's bootstrap port {state.bootstrap_port}."
        ranks = body.get("routed_dp_rank")
        if ranks is not None:
            for room, rank in zip(_as_list(body["bootstrap_room"], n), _as_list(ranks, n), strict=False):
                if room % state.dp_size != rank:
                    return f"bootstrap_room {room} % dp_size {state.dp_size} != routed_dp_rank {rank}."
    return None


def _check_input(path: str, body: dict[str, Any]) -> str | None:
    if path == "/v1/chat/completions" and not (isinstance(body.get("messages"), list) and body["messages"]):
        return "messages must be a non-empty list"
    if path == "/v1/completions" and "prompt" not in body:
        return "prompt is required"
    if path == "/generate" and "text" not in body and "input_ids" not in body:
        return "text or input_ids is required"
    return None


def _chunk(path: str, rid: str, model: str, i: int, text: str, finish: str | None) -> dict[str, Any]:
    created = int(time.time())
    if path == "/v1/chat/completions":
        delta: dict[str, Any] = {"content": text}
        if i == 0:
            delta["role"] = "assistant"
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }


def _final(path: str, rid: str, model: str, text: str, finish: str, prompt: int, completion: int) -> Any:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    created = int(time.time())
    if path == "/v1/chat/completions":
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


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


def build_app(state: _State) -> Any:
    from aiohttp import ClientSession, ClientTimeout, web

    app = web.Application(client_max_size=64 * 1024 * 1024)
    session_holder: dict[str, ClientSession] = {}

    async def on_startup(_: web.Application) -> None:
        session_holder["s"] = ClientSession(timeout=ClientTimeout(total=state.handshake_timeout))

    async def on_cleanup(_: web.Application) -> None:
        await session_holder["s"].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def handshake(body: dict[str, Any], n: int | None) -> str | None:
        """Decode side: fetch each room's KV hand-off from the prefill's bootstrap server."""
        hosts = _as_list(body["bootstrap_host"], n)
        ports = _as_list(body["bootstrap_port"], n)
        rooms = _as_list(body["bootstrap_room"], n)
        for host, port, room in zip(hosts, ports, rooms, strict=False):
            url = f"http://{host}:{port}/kv/{room}"
            try:
                async with session_holder["s"].get(url) as resp:
                    if resp.status != 200:
                        return f"KV transfer for room {room} failed: bootstrap answered {resp.status}"
                    await resp.read()
            except Exception as exc:
                return f"KV transfer for room {room} from {host}:{port} failed: {type(exc).__name__} {exc}"
        return None

    def rids_of(body: dict[str, Any], n: int | None) -> list[str]:
        return [str(r) for r in _as_list(body.get("rid") or "", n)]

    async def generate(request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            body = await request.json()
        except ValueError:
            return _err(400, "invalid JSON")
        if not isinstance(body, dict):
            return _err(400, "body must be an object")
        problem = _check_input(path, body) or _check_bootstrap(state, path, body)
        if problem:
            return _err(400, problem)
        if state.fail_count > 0:
            state.fail_count -= 1
            return _err(state.fail_status or 500, "injected failure")
        n = _batch(path, body)
        rids = rids_of(body, n)
        if state.keep_log:
            state.requests.append(
                {
                    "path": path,
                    "rid": body.get("rid"),
                    "room": body["bootstrap_room"],
                    "host": body["bootstrap_host"],
                    "port": body["bootstrap_port"],
                    "routed_dp_rank": body.get("routed_dp_rank"),
                    "stream": bool(body.get("stream")),
                    "headers": {k.lower(): v for k, v in request.headers.items() if k.lower() in _SEEN_HEADERS},
                }
            )
        state.in_flight += 1
        try:
            if state.role == "prefill":
                return await prefill(request, path, body, n, rids)
            return await decode(request, path, body, n, rids)
        except ConnectionResetError:  # the router hung up (abort, disconnect): nothing to answer
            return web.Response(status=499)
        finally:
            state.in_flight -= 1

    async def prefill(request: web.Request, path: str, body: dict[str, Any], n: int | None, rids: list[str]) -> Any:
        if state.prefill_delay:
            await asyncio.sleep(state.prefill_delay)
        prompt = _prompt_len(body)
        aborted = any(r in state.aborted for r in rids)
        if not aborted:
            for room in _as_list(body["bootstrap_room"], n):
                fut = state.rooms.get(room)
                if fut is None:
                    fut = state.rooms[room] = asyncio.get_running_loop().create_future()
                    state.room_times[room] = time.monotonic()
                if not fut.done():
                    fut.set_result({"input_len": prompt})
        rid = rids[0]
        finish = "abort" if aborted else "length"
        if path == "/generate":
            one = {
                "text": "",
                "meta_info": _generate_meta(rid, prompt, 0, finish, bool(body.get("return_logprob")), "prefill"),
            }
            out: Any = [dict(one, index=i) for i in range(n)] if n is not None else one
        else:
            out = _final(path, rid, state.model, "", finish, prompt, 0)
        if body.get("stream"):
            events = out if isinstance(out, list) else [out]
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            return web.Response(body=payload, content_type="text/event-stream")
        return web.json_response(out)

    async def decode(request: web.Request, path: str, body: dict[str, Any], n: int | None, rids: list[str]) -> Any:
        stream = bool(body.get("stream"))
        total = min(_max_tokens(body, state.tokens), _MAX_TOKENS)
        prompt = _prompt_len(body)
        rid = rids[0]
        resp: web.StreamResponse | None = None
        if stream:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
            await resp.prepare(request)
        failure = await handshake(body, n)
        if failure:
            if resp is None:
                return _err(500, failure)
            await resp.write(
                b"data: "
                + json.dumps(
                    {"error": {"message": failure, "type": "InternalServerError", "param": None, "code": 500}}
                ).encode()
                + b"\n\n"
            )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = ""
        finish = "length"
        produced = 0
        for i in range(total):
            if any(r in state.aborted for r in rids):
                finish = "abort"
                break
            if state.token_delay:
                await asyncio.sleep(state.token_delay)
            piece = f" tok{i}"
            text += piece
            produced += 1
            if resp is not None:
                fin = "length" if i == total - 1 else None
                if path == "/generate":
                    event: Any = {
                        "text": text,
                        "index": 0,
                        "meta_info": _generate_meta(
                            rid, prompt, produced, fin or "", bool(body.get("return_logprob")), "decode"
                        ),
                    }
                else:
                    event = _chunk(path, rid, state.model, i, piece, fin)
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if resp is not None:
            options = body.get("stream_options") or {}
            if path != "/generate" and isinstance(options, dict) and options.get("include_usage"):
                usage = {
                    "prompt_tokens": prompt,
                    "completion_tokens": produced,
                    "total_tokens": prompt + produced,
                }
                final = _chunk(path, rid, state.model, produced, "", None)
                final["choices"] = []
                final["usage"] = usage
                await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if path == "/generate":
            one = {
                "text": text,
                "meta_info": _generate_meta(rid, prompt, produced, finish, bool(body.get("return_logprob")), "decode"),
            }
            return web.json_response([dict(one, index=i) for i in range(n)] if n is not None else one)
        return web.json_response(_final(path, rid, state.model, text, finish, prompt, produced))

    async def abort(request: web.Request) -> web.Response:
        body = await request.json()
        rid = str(body.get("rid", ""))
        state.aborts.append(rid)
        state.aborted.add(rid)
        return web.json_response({"success": True})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": state.model,
                "served_model_name": state.model,
                "disaggregation_mode": state.role,
                "dp_size": state.dp_size,
                "enable_dp_attention": state.dp_size > 1,
                "tp_size": 1,
                "disaggregation_bootstrap_port": state.bootstrap_port,
                "version": "test-worker",
            }
        )

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": state.model, "tokenizer_path": state.model, "is_generation": True})

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "sglang"}],
            }
        )

    async def loads(_: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, "num_reqs": state.in_flight}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"sglang:num_running_reqs {state.in_flight}\n")

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def test_state(_: web.Request) -> web.Response:
        return web.json_response({"requests": state.requests, "aborts": state.aborts, "in_flight": state.in_flight})

    async def test_config(request: web.Request) -> web.Response:
        body = await request.json()
        for key in ("fail_status", "fail_count", "token_delay", "prefill_delay", "tokens", "keep_log"):
            if key in body:
                setattr(state, key, body[key])
        if body.get("reset"):
            state.requests.clear()
            state.aborts.clear()
        return web.json_response({"success": True})

    for path in ENDPOINTS:
        app.router.add_post(path, generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", ok)
    app.router.add_get("/_test/state", test_state)
    app.router.add_post("/_test/config", test_config)
    return app


def build_bootstrap_app(state: _State) -> Any:
    from aiohttp import web

    app = web.Application()

    async def kv(request: web.Request) -> web.Response:
        room = int(request.match_info["room"])
        fut = state.rooms.get(room)
        if fut is None:
            fut = state.rooms[room] = asyncio.get_running_loop().create_future()
            state.room_times[room] = time.monotonic()
        try:
            info = await asyncio.wait_for(asyncio.shield(fut), state.handshake_timeout)
        except TimeoutError:
            return web.json_response({"error": f"room {room} was never prefilled"}, status=404)
        finally:
            if fut.done():
                state.rooms.pop(room, None)
                state.room_times.pop(room, None)
        return web.json_response(info)

    async def route(_: web.Request) -> web.Response:
        return web.json_response({"prefill_dp_size": state.dp_size, "role": "prefill"})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    app.router.add_get("/kv/{room}", kv)
    app.router.add_get("/route", route)
    app.router.add_get("/health", health)
    return app


async def _sweep(state: _State) -> None:
    """Forget rooms no decode came for (the prefill-only side of an aborted request)."""
    while True:
        await asyncio.sleep(5.0)
        cutoff = time.monotonic() - max(30.0, state.handshake_timeout * 2)
        for room, t in list(state.room_times.items()):
            if t < cutoff:
                state.rooms.pop(room, None)
                state.room_times.pop(room, None)


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    state = _State(
        role=args.role,
        model=args.model,
        dp_size=args.dp_size,
        bootstrap_port=0,
        tokens=args.tokens,
        token_delay=args.token_delay,
        prefill_delay=args.prefill_delay,
        handshake_timeout=args.handshake_timeout,
        keep_log=not args.no_log,
    )
    runners = []
    bootstrap_port = None
    if args.role == "prefill":
        boot = web.AppRunner(build_bootstrap_app(state), access_log=None, shutdown_timeout=0.5)
        await boot.setup()
        site = web.TCPSite(boot, args.host, args.bootstrap_port, backlog=4096)
        await site.start()
        bootstrap_port = boot.addresses[0][1]
        state.bootstrap_port = bootstrap_port
        runners.append(boot)
    runner = web.AppRunner(build_app(state), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096)
    await site.start()
    runners.append(runner)
    port = runner.addresses[0][1]
    print(json.dumps({"port": port, "bootstrap_port": bootstrap_port, "pid": os.getpid()}), flush=True)
    sweeper = asyncio.create_task(_sweep(state))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    sweeper.cancel()
    for r in reversed(runners):
        await r.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A protocol-faithful PD test worker (no model).")
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bootstrap-port", type=int, default=0)
    parser.add_argument("--model", default="test-model")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="tokens to emit when the request sets no limit")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prefill-delay", type=float, default=0.0)
    parser.add_argument("--handshake-timeout", type=float, default=10.0)
    parser.add_argument("--no-log", action="store_true", help="keep no per-request log (benchmarks)")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args))
    return 0


# -- launching from tests and benchmarks ------------------------------------------------------------


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen[str]
    port: int
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the worker dies mid-request, as a crashed node would."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _spawn(role: str, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "sglang_pd.deploy.router.testing", "--role", role, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)


def _ready(role: str, proc: subprocess.Popen[str], timeout: float) -> WorkerProcess:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.1):
            line = proc.stdout.readline()
            if line:
                info = json.loads(line)
                sel.close()
                return WorkerProcess(role, proc, info["port"], info["bootstrap_port"])
        if proc.poll() is not None:
            break
    sel.close()
    with contextlib.suppress(Exception):
        proc.kill()
    raise RuntimeError(f"The {role} test worker did not start within {timeout} s (exit code {proc.poll()}).")


def _flags(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (None, False):
            out += [flag, str(value)]
    return out


def start_worker(role: str, timeout: float = 20.0, **options: Any) -> WorkerProcess:
    return _ready(role, _spawn(role, _flags(options)), timeout)


def start_workers(
    n_prefill: int, n_decode: int, timeout: float = 20.0, **options: Any
) -> tuple[list[WorkerProcess], list[WorkerProcess]]:
    """Start workers in parallel; returns (prefills, decodes). Stops what started if one fails."""
    procs = [("prefill", _spawn("prefill", _flags(options))) for _ in range(n_prefill)]
    procs += [("decode", _spawn("decode", _flags(options))) for _ in range(n_decode)]
    started: list[WorkerProcess] = []
    try:
        for role, proc in procs:
            started.append(_ready(role, proc, timeout))
    except BaseException:
        for w in started:
            w.stop()
        for _, proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
        raise
    return [w for w in started if w.role == "prefill"], [w for w in started if w.role == "decode"]


if __name__ == "__main__":
    sys.exit(main())
