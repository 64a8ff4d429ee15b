"""A deterministic OpenAI-compatible gsm8k server on loopback, for tests and the harness benchmark.

It serves `/v1/models`, `/v1/completions` and `/v1/chat/completions` over real HTTP (aiohttp in a
background thread), finds the last `Question: ...\\nAnswer:` of the prompt and answers from a script:
the right number, a wrong one, no number at all, transient 503s or closed connections before
answering, 500 forever, malformed 200s (not JSON, a number as the text, a body that is not the gzip
it claims to be), or an answer cut at max_tokens.

    answers = scripted_answers(problems, correct=lambda p: p.index % 2 == 0)
    with Gsm8kTestServer(answers) as server:
        ... server.base_url ...   # "http://127.0.0.1:PORT/v1"
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sglang_pd.deploy.evals.data import Problem

__all__ = ["Gsm8kTestServer", "ServerScript", "scripted_answers"]

_QUESTION, _ANSWER = "Question: ", "\nAnswer:"


def _format(label: str) -> str:
    """The label as a person writes it: thousands separated by commas when it is an integer."""
    return f"{int(label):,}" if label.lstrip("-").isdigit() else label


def _plus_one(label: str) -> str:
    return str(int(label) + 1) if label.lstrip("-").isdigit() else label + "1"


def scripted_answers(
    problems: Iterable[Problem],
    *,
    correct: Callable[[Problem], bool],
    invalid: Callable[[Problem], bool] = lambda p: False,
) -> dict[str, str]:
    """Question text → completion: right for `correct`, no number for `invalid`, else off by one."""
    out: dict[str, str] = {}
    for p in problems:
        if invalid(p):
            out[p.question] = " I cannot work this one out."
        elif correct(p):
            out[p.question] = f" Adding it up step by step gives the total.\n#### {_format(p.label)}"
        else:
            out[p.question] = f" Adding it up step by step gives the total.\n#### {_format(_plus_one(p.label))}"
    return out


@dataclass(slots=True)
class ServerScript:
    """What the server answers. `flaky[q]`: how many first attempts of q get a 503; `dropped[q]`: how many
    have their connection closed with no answer; `broken`: always 500; `malformed[q]`: how many get a 200
    that is not JSON; `number_text`: a 200 whose text is a number, not a string; `bad_gzip`: a 200
    claiming gzip that is not; `truncated`: answered with finish_reason "length"."""

    answers: Mapping[str, str]
    flaky: Mapping[str, int] = field(default_factory=dict)
    dropped: Mapping[str, int] = field(default_factory=dict)
    broken: frozenset[str] = frozenset()
    malformed: Mapping[str, int] = field(default_factory=dict)
    number_text: frozenset[str] = frozenset()
    bad_gzip: frozenset[str] = frozenset()
    truncated: frozenset[str] = frozenset()
    default: str = " I do not know."
    model: str = "gsm8k-test"
    # When set, every request must carry `Authorization: Bearer <api_key>` (else 401).
    api_key: str | None = None
    # The first this many `GET /v1/models` list no model (a router before its workers are healthy).
    empty_model_lists: int = 0


def _question_of(prompt: str) -> str:
    start = prompt.rfind(_QUESTION)
    if start < 0:
        return ""
    body = prompt[start + len(_QUESTION) :]
    end = body.rfind(_ANSWER)
    return body[:end] if end >= 0 else body


class Gsm8kTestServer:
    """Serves `script` on 127.0.0.1 (a free port) from a background thread; use as a context manager."""

    def __init__(self, script: ServerScript | Mapping[str, str]) -> None:
        self.script = script if isinstance(script, ServerScript) else ServerScript(answers=script)
        # Attempts seen per question, and the request bodies (for checks on what the harness sends).
        self.attempts: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        # The client ports requests came from (one per connection the client opened).
        self.peers: set[Any] = set()
        self.model_lists = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.script.api_key and request.headers.get("Authorization") != f"Bearer {self.script.api_key}":
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _models(self, _: web.Request) -> web.Response:
        self.model_lists += 1
        if self.model_lists <= self.script.empty_model_lists:
            return web.json_response({"object": "list", "data": []})
        return web.json_response({"object": "list", "data": [{"id": self.script.model, "object": "model"}]})

    def _answer(self, request: web.Request, question: str) -> web.Response | str:
        self.attempts[question] += 1
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        attempt, script = self.attempts[question], self.script
        if question in script.broken:
            return web.json_response({"error": {"message": "internal error (scripted)"}}, status=500)
        dropped = script.dropped.get(question, 0)
        if attempt <= dropped:
            assert request.transport is not None
            request.transport.close()  # the client sees the connection closed before any answer
            return web.Response(status=500)
        attempt -= dropped
        if attempt <= script.flaky.get(question, 0):
            return web.json_response({"error": {"message": "overloaded (scripted)"}}, status=503)
        attempt -= script.flaky.get(question, 0)
        if attempt <= script.malformed.get(question, 0):
            return web.Response(status=200, text="<html>upstream proxy error</html>", content_type="text/html")
        if question in script.bad_gzip:
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            return web.Response(status=200, body=b"this is not gzip at all", headers=headers)
        return script.answers.get(question, script.default)

    def _finish(self, question: str) -> str:
        return "length" if question in self.script.truncated else "stop"

    @staticmethod
    def _usage(text: str) -> dict[str, int]:
        return {"prompt_tokens": 1, "completion_tokens": len(text.split()), "total_tokens": 1 + len(text.split())}

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        question = _question_of(str(body.get("prompt", "")))
        answer = self._answer(request, question)
        if isinstance(answer, web.Response):
            return answer
        text: Any = 42 if question in self.script.number_text else answer
        choice = {"index": 0, "text": text, "finish_reason": self._finish(question), "logprobs": None}
        return web.json_response(
            {
                "id": "cmpl-test",
                "object": "text_completion",
                "model": self.script.model,
                "choices": [choice],
                "usage": self._usage(answer),
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        messages = body.get("messages") or [{}]
        question = _question_of(str(messages[-1].get("content", "")))
        answer = self._answer(request, question)
        if isinstance(answer, web.Response):
            return answer
        content: Any = 42 if question in self.script.number_text else answer
        message = {"role": "assistant", "content": content}
        choice = {"index": 0, "message": message, "finish_reason": self._finish(question)}
        return web.json_response(
            {
                "id": "chat-test",
                "object": "chat.completion",
                "model": self.script.model,
                "choices": [choice],
                "usage": self._usage(answer),
            }
        )

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        runner = web.AppRunner(self._app(), access_log=None)
        try:
            self._stop = asyncio.Event()
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, self._sock).start())
            self._ready.set()
            loop.run_until_complete(self._stop.wait())
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._failure = exc
            self._ready.set()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def start(self) -> Gsm8kTestServer:
        if self._thread is not None:
            raise RuntimeError("Cannot start the test server twice.")
        self._thread = threading.Thread(target=self._serve, name=f"gsm8k-test-server:{self.port}", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._failure is not None or not self._ready.is_set():
            self.stop()
            raise RuntimeError(f"The gsm8k test server did not start: {self._failure!r}")
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        self._sock.close()
        self._thread = None

    def __enter__(self) -> Gsm8kTestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
