"""Record what a running sglang server answers at the HTTP level, for the tests' stand-ins.

The router and the gsm8k gate rely on a handful of sglang's endpoints. This records, from a live
server, each one's status, timing and body shape (field names and types, and the values a router
reads), so that `tests/support/test_doubles_match_sglang.py` can hold every stand-in to them:

- `/health`, `/health_generate` (sglang's `health_generate`: a one-token generation, answered after
  at least one 1 s tick), idle and while requests stream; `/ping`, `/v1/models`, `/get_model_info`;
- `/server_info`: its keys and the parallel-layout fields;
- error bodies: an unknown path, a malformed body, a request without its prompt, a prompt longer
  than the context, an unknown model;
- `/abort_request` for an unknown id, and a streamed request aborted by its id.

    python scripts/gpu/record_sglang_http.py http://127.0.0.1:30000 --role single   # prints JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

# The `/server_info` fields whose values a router or the gate reads.
SERVER_INFO_FIELDS = (
    "version",
    "dp_size",
    "attn_dp_size",
    "enable_dp_attention",
    "tp_size",
    "max_running_requests",
    "max_total_num_tokens",
    "context_length",
    "page_size",
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "served_model_name",
    "chunked_prefill_size",
)


def shape(value: Any) -> Any:
    """A JSON value's structure: dict keys with the shape of each value, a list's first item, types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


async def _get(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with s.get(url) as r:
        raw = await r.read()
        out: dict[str, Any] = {"status": r.status, "seconds": round(time.perf_counter() - t0, 3)}
        out["content_type"] = r.headers.get("content-type", "")
        out["body"] = _decode(raw)
        return out


async def _post(s: aiohttp.ClientSession, url: str, data: bytes) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with s.post(url, data=data, headers={"content-type": "application/json"}) as r:
        raw = await r.read()
        return {
            "status": r.status,
            "seconds": round(time.perf_counter() - t0, 3),
            "content_type": r.headers.get("content-type", ""),
            "body": _decode(raw),
        }


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]


async def _health_timings(s: aiohttp.ClientSession, base: str, path: str, n: int) -> dict[str, Any]:
    answers = [await _get(s, base + path) for _ in range(n)]
    return {"statuses": sorted({a["status"] for a in answers}), "seconds": [a["seconds"] for a in answers]}


async def _stream_for(s: aiohttp.ClientSession, base: str, seconds: float, model: str) -> None:
    """Keep one streamed completion running for `seconds` (the server is busy meanwhile)."""
    body = {"model": model, "prompt": "busy", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        async with s.post(f"{base}/v1/completions", json=body) as r:
            async for _ in r.content:
                if time.monotonic() > deadline:
                    break


async def _aborted_stream(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """A streamed /generate with our rid, aborted by that rid after its first chunk: how it ends."""
    rid = f"record-abort-{time.time_ns()}"
    body = {
        "text": "abort me",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
    }
    events: list[Any] = []
    abort: dict[str, Any] = {}
    async with s.post(f"{base}/generate", json=body) as r:
        status = r.status
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 1:
                abort = await _post(s, f"{base}/abort_request", json.dumps({"rid": rid}).encode())
            if len(events) > 10000:
                break
    last = next((e for e in reversed(events) if isinstance(e, dict)), {})
    meta = last.get("meta_info", {}) if isinstance(last, dict) else {}
    return {
        "status": status,
        "abort_status": abort.get("status"),
        "events": len(events),
        "ends_with_done": bool(events) and events[-1] == "[DONE]",
        "last_finish_reason": meta.get("finish_reason"),
        "last_event_shape": shape(last),
    }


async def record(base: str, role: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as s:
        models = await _get(s, f"{base}/v1/models")
        model = models["body"]["data"][0]["id"] if models["status"] == 200 else "default"
        info = await _get(s, f"{base}/server_info")
        body = info["body"] if isinstance(info["body"], dict) else {}
        internal = body.get("internal_states") or [{}]
        out: dict[str, Any] = {
            "role": role,
            "health": await _health_timings(s, base, "/health", 5),
            "health_generate": await _health_timings(s, base, "/health_generate", 3),
            "ping": await _get(s, f"{base}/ping"),
            "v1_models": {"status": models["status"], "body": models["body"], "shape": shape(models["body"])},
            "get_model_info": await _get(s, f"{base}/get_model_info"),
            "server_info": {
                "status": info["status"],
                "keys": sorted(body),
                "fields": {k: body.get(k) for k in SERVER_INFO_FIELDS if k in body},
                "internal_state_keys": sorted(internal[0]) if isinstance(internal[0], dict) else [],
            },
        }
        if role != "single":
            return out  # a PD server serves only requests with bootstrap fields; the rest needs none
        busy = [asyncio.create_task(_stream_for(s, base, 8.0, model)) for _ in range(4)]
        await asyncio.sleep(1.0)
        out["health_busy"] = await _health_timings(s, base, "/health", 3)
        await asyncio.gather(*busy)
        too_long = "x " * 20000
        out["errors"] = {
            "unknown_path": await _get(s, f"{base}/no_such_endpoint"),
            "chat_malformed_json": await _post(s, f"{base}/v1/chat/completions", b"{not json"),
            "chat_without_messages": await _post(
                s, f"{base}/v1/chat/completions", json.dumps({"model": model}).encode()
            ),
            "completion_unknown_model": await _post(
                s, f"{base}/v1/completions", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()
            ),
            "completion_longer_than_context": await _post(
                s, f"{base}/v1/completions", json.dumps({"model": model, "prompt": too_long, "max_tokens": 4}).encode()
            ),
            "generate_without_text": await _post(s, f"{base}/generate", json.dumps({"sampling_params": {}}).encode()),
        }
        out["abort"] = {
            "unknown_rid": await _post(s, f"{base}/abort_request", json.dumps({"rid": "no-such-rid"}).encode()),
            "stream_aborted_by_rid": await _aborted_stream(s, base),
        }
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the server's http://HOST:PORT")
    parser.add_argument("--role", default="single", choices=("single", "prefill", "decode"))
    args = parser.parse_args()
    print(json.dumps(asyncio.run(record(args.base.rstrip("/"), args.role)), indent=2))


if __name__ == "__main__":
    main()
