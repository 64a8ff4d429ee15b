"""Request migration on the OpenAI routes with real processes: 1 prefill and 2 decode reference
engines (fp32, greedy) behind the router; one decode SIGKILLed while streamed `/v1/completions`
and `/v1/chat/completions` requests, and unary requests of all three routes, are open.

With `--migration-limit 1` every stream completes without an error event, with one id, the role
delta once (chat), its usage as an uninterrupted run reports it (the client's prompt tokens, every
completion token counted once), and text equal to the uninterrupted run's (a moved chat stream
excepted: its continuation is text-level, migration_openai.py); every unary request
gets the uninterrupted run's answer (it is retried from the start: nothing had reached its client).
The control: with `--migration-limit 0` the same kill ends the killed decode's streams with the
error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from .conftest import TINY_MODEL, Proc, launcher
from .test_migration import MOONCAKE_PORTS, _all_admitted, _decoding, _moved_ids, _router

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real processes, about 30 s on 2 idle cores

STREAMS = 8  # per route
UNARY = 4  # per route
MAX_NEW = 48
HANG_S = 120.0


@dataclass
class Answer:
    text: str = ""
    error: str = ""
    done: bool = False
    ids: set[str] = field(default_factory=set)
    roles: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    chunks: int = 0


def _request(route: str, i: int, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": TINY_MODEL, "temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"Question {i}: what comes next?"}]
    elif i % 2:
        body["prompt"] = [(11 * i + k) % 200 + 10 for k in range(4 + i % 5)]  # token ids
    else:
        body["prompt"] = f"Completion number {i} begins"
    return body


async def _stream(client: httpx.AsyncClient, url: str, route: str, i: int, progress: dict[str, int]) -> Answer:
    out = Answer()
    key = f"{route}-{i}"
    async with client.stream("POST", url + route, json=_request(route, i, True), headers={"x-request-id": key}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                out.error = json.dumps(obj["error"])
                continue
            out.ids.add(obj["id"])
            if obj.get("usage"):
                out.usage = obj["usage"]
            for choice in obj["choices"]:
                assert "token_ids" not in choice and "prompt_token_ids" not in choice, choice
                if route == "/v1/chat/completions":
                    delta = choice["delta"]
                    out.roles += "role" in delta
                    out.text += delta.get("content") or ""
                else:
                    out.text += choice["text"]
                out.chunks += 1
                progress[key] = out.chunks
    return out


async def _unary(client: httpx.AsyncClient, url: str, route: str, i: int) -> Answer:
    r = await client.post(url + route, json=_request(route, i, False), headers={"x-request-id": f"u{route}-{i}"})
    out = Answer(done=r.status_code == 200)
    if r.status_code != 200:
        out.error = r.text
        return out
    obj = r.json()
    choice = obj["choices"][0]
    out.text = choice["message"]["content"] if route == "/v1/chat/completions" else choice["text"]
    out.usage, out.ids = obj["usage"], {obj["id"]}
    return out


ROUTES = ("/v1/completions", "/v1/chat/completions")


async def _run(url: str, kill: Proc | None) -> tuple[dict[str, Answer], dict[str, Answer]]:
    progress: dict[str, int] = {f"{r}-{i}": 0 for r in ROUTES for i in range(STREAMS)}
    limits = httpx.Limits(max_connections=len(progress) + 2 * UNARY + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits) as client:
        streams = {
            f"{r}-{i}": asyncio.ensure_future(_stream(client, url, r, i, progress))
            for r in ROUTES
            for i in range(STREAMS)
        }
        unary = {f"{r}-{i}": asyncio.ensure_future(_unary(client, url, r, i)) for r in ROUTES for i in range(UNARY)}
        if kill is not None:
            # Half the streams of each route in mid-answer at once (they start apart: the prefill
            # takes them one batch at a time), and the victim decoding: round robin puts about half of
            # those streams on it. A stream before its first token is retried, not moved.
            deadline = time.monotonic() + HANG_S
            while not all(
                sum(3 <= progress[f"{r}-{i}"] <= MAX_NEW - 8 for i in range(STREAMS)) >= STREAMS // 2 for r in ROUTES
            ) or not await _decoding(kill):
                assert time.monotonic() < deadline and not all(t.done() for t in streams.values()), progress
                await asyncio.sleep(0.005)
            kill.kill()
        tasks = [*streams.values(), *unary.values()]
        _, pending = await asyncio.wait(tasks, timeout=HANG_S)
        for t in pending:
            t.cancel()
        assert not pending, f"{len(pending)} request(s) hung"
        return {k: t.result() for k, t in streams.items()}, {k: t.result() for k, t in unary.items()}


def test_openai_streams_move_and_unary_requests_complete(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        prefill = lx.engine("prefill", env=MOONCAKE_PORTS)
        d1, d2 = lx.engine("decode", env=MOONCAKE_PORTS), lx.engine("decode", env=MOONCAKE_PORTS)
        router = _router(lx, prefill, [d1, d2], limit=1)
        lx.wait()
        _all_admitted(router)
        base_streams, base_unary = asyncio.run(_run(router.url, None))
        for key, a in {**base_streams, **base_unary}.items():
            assert a.done and not a.error and a.usage["completion_tokens"] == MAX_NEW, (key, a)
        streams, unary = asyncio.run(_run(router.url, d1))
        moved = _moved_ids(router)
        metrics = router.metrics()

        d3 = lx.engine("decode", env=MOONCAKE_PORTS)
        control = _router(lx, prefill, [d3, d2], limit=0)
        lx.wait(d3, control)
        _all_admitted(control)
        broken, _ = asyncio.run(_run(control.url, d3))

    assert {k for k in moved if k.startswith("/v1/chat")}, f"no chat stream moved: {moved}"
    assert {k for k in moved if k.startswith("/v1/completions")}, f"no completions stream moved: {moved}"
    chat_same = 0
    for key, a in streams.items():
        base = base_streams[key]
        assert a.done and not a.error, (key, a.error)
        assert len(a.ids) == 1, (key, a.ids)
        assert a.usage == base.usage, (key, a.usage, base.usage)
        if key.startswith("/v1/chat"):
            assert a.roles == 1, (key, a.roles)
            if key in moved:
                # Text-level: the continuation's prompt is the delivered text tokenized again, which
                # equals the generated ids only where that text gives them back (this byte-level
                # model's answers hold invalid UTF-8, decoded as U+FFFD).
                chat_same += a.text == base.text
                continue
        if key not in moved or "\ufffd" not in base.text:  # a move may split a multi-byte character
            assert a.text == base.text, (key, a.text, base.text)
    for key, a in unary.items():
        assert a.done and not a.error, (key, a.error)
        assert (a.text, a.usage) == (base_unary[key].text, base_unary[key].usage), key
    assert metrics.get('sglang_pd_router_migrations_total{outcome="migrated"}') == len(moved), metrics

    ended_in_error = {k for k, a in broken.items() if a.error}
    assert ended_in_error, "limit 0: the kill should have ended the killed decode's streams with the error event"
    assert {k.split("-")[0] for k in ended_in_error} == set(ROUTES), ended_in_error
    chat_moved = len([k for k in moved if k.startswith("/v1/chat")])
    print(
        f"\nopenai migration: {len(moved)} of {len(streams)} streams moved ({chat_moved} chat, {chat_same} of them "
        f"with the uninterrupted text); control: {len(ended_in_error)} broken"
    )


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
