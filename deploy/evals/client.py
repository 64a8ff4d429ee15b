"""An async client for one OpenAI-compatible endpoint: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

One aiohttp session with one connection pool sized to `--parallel` (as the router's upstream
client): the harness must not be what limits a fast endpoint. Three kinds of trouble are kept
apart and counted, never dropped:

- transient failures (connection errors, timeouts, 408/429/5xx) are retried with exponential
  backoff; a question whose *first* attempt failed counts towards `--max-retry-rate`;
- a malformed 200 (not JSON, no choices, a non-string text, a body that does not decode) is asked
  again once and counts towards `--max-invalid-rate`;
- anything else (a 400, a 404) fails the question at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from .errors import EndpointUnreachable, UsageError
from .prompt import STOP

__all__ = [
    "DEFAULT_RETRY",
    "Api",
    "ClientConfig",
    "Completion",
    "EndpointClient",
    "QuestionFailed",
    "RetryPolicy",
]

Api = Literal["completions", "chat"]
FailureKind = Literal["transient", "http", "invalid_response"]

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """`max_retries` extra attempts per request, waiting `backoff_s * 2**k` (capped) before each."""

    max_retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        base = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        # Jitter spreads the retries of many concurrent requests after a shared blip.
        return base * random.uniform(0.5, 1.0)


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    base_url: str
    api: Api = "completions"
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_tokens: int = 512
    temperature: float = 0.0
    parallel: int = 128
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    retry: RetryPolicy = DEFAULT_RETRY
    # Every request pinned to this revision of an sglang-pd router (x-sglpd-revision; approval.py); None: not pinned.
    revision: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    completion_tokens: int | None
    finish_reason: str | None
    latency_s: float
    retries: int
    # The first attempt failed transiently (retried and then answered).
    first_attempt_failed: bool = False
    # Malformed 200 responses seen before this good one (0 or 1).
    invalid_responses: int = 0


class QuestionFailed(Exception):
    """One question's request failed for good: `kind` says how (see the module docstring)."""

    def __init__(
        self,
        message: str,
        retries: int,
        *,
        kind: FailureKind = "transient",
        first_attempt_failed: bool = False,
        invalid_responses: int = 0,
    ) -> None:
        super().__init__(message)
        self.retries = retries
        self.kind = kind
        self.first_attempt_failed = first_attempt_failed
        self.invalid_responses = invalid_responses


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Malformed(Exception):
    """A 200 whose body is not the OpenAI response it should be."""


def _retry_after(headers: Any) -> float | None:
    try:
        return max(0.0, float(headers["retry-after"]))
    except (KeyError, ValueError, TypeError):
        return None


def _describe(status: int, url: str, body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return f"HTTP {status} from {url}: {text[:300]}"


def _is_decoding_error(exc: aiohttp.ClientPayloadError) -> bool:
    # aiohttp reports a body that does not decompress (bad gzip/deflate) as a payload error whose
    # text names the encoding; a connection cut mid-body is a payload error too, but transient.
    text = f"{exc} {exc.__cause__!r}".lower()
    return any(word in text for word in ("encoding", "decompress", "gzip", "deflate", "brotli"))


def _model_ids(url: str, body: bytes) -> list[str]:
    try:
        return [str(m["id"]) for m in orjson.loads(body)["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EndpointUnreachable(
            f"{url} did not answer an OpenAI model list ({body[:200]!r}); check --base-url (it should end in /v1)."
        ) from exc


class EndpointClient:
    """Use as `async with EndpointClient(config) as client:`; `resolve_model()` first, then `complete()`."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self.model: str | None = config.model
        # Every retry of a question's request, including those of requests cancelled mid-way.
        self.retries = 0
        self._headers = {"Content-Type": "application/json"}
        if config.api_key:
            self._headers["Authorization"] = f"Bearer {config.api_key}"
        if config.revision:
            self._headers["x-sglpd-revision"] = config.revision
        self._timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=config.connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use: an aiohttp session belongs to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.config.parallel, limit_per_host=self.config.parallel, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=True,  # honour HTTP(S)_PROXY / NO_PROXY, as curl and the OpenAI SDK do
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, url: str) -> tuple[int, bytes, Any]:
        async with self.session.get(url) as response:
            return response.status, await response.read(), response.headers

    async def resolve_model(self, wait_s: float = 0.0) -> str:
        """Check that the endpoint answers `GET /models`; return --model, else the first model it serves.

        Connection errors, 408/429/5xx and an empty model list (a router whose workers are not healthy
        yet) are retried `max_retries` times, and for at least `wait_s` seconds (a Job started beside
        the pods it checks)."""
        url = f"{self.base_url}/models"
        hint = "Check --base-url (the server's OpenAI base URL, ending in /v1) and that the server is up"
        retry = self.config.retry
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            cause: Exception | None = None
            retry_after: float | None = None
            try:
                status, body, headers = await self._get(url)
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem, cause = f"Cannot reach {url} ({type(exc).__name__}: {exc}). {hint}", exc
            else:
                if status in (401, 403):
                    raise EndpointUnreachable(
                        f"{_describe(status, url, body)}. Pass the key with --api-key or OPENAI_API_KEY."
                    )
                if status in TRANSIENT_STATUS:
                    problem, retry_after = f"{_describe(status, url, body)}. {hint}", _retry_after(headers)
                elif status != 200:
                    raise EndpointUnreachable(f"{_describe(status, url, body)}. {hint}.")
                else:
                    models = _model_ids(url, body)
                    if models and self.model is not None and self.model not in models:
                        # Every question would get the server's 404 for an unknown model: a wrong flag, not
                        # an endpoint to judge (exit 2, not 4).
                        raise UsageError(
                            f"--model {self.model!r} is not served at {self.base_url}: {url} lists "
                            f"{', '.join(repr(m) for m in models)}. Pass one of them with --model, or leave "
                            "--model out to use the first."
                        )
                    if models:
                        self.model = self.model or models[0]
                        return self.model
                    problem = f"{url} lists no model yet (a router with no healthy worker?): {body[:200]!r}"
            remaining = deadline - time.monotonic()
            if attempt >= retry.max_retries and remaining <= 0:
                if self.model is not None and cause is None and retry_after is None:
                    return self.model  # a server that lists no model but was named one: let the requests tell
                raise EndpointUnreachable(f"{problem}; --wait-ready SECONDS waits longer.") from cause
            delay = retry.delay(attempt, retry_after)
            await asyncio.sleep(min(delay, 5.0, remaining) if remaining > 0 else delay)
            attempt += 1

    def _body(self, prompt: str) -> tuple[str, bytes]:
        common: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        if self.config.api == "chat":
            body = {**common, "messages": [{"role": "user", "content": prompt}]}
            return f"{self.base_url}/chat/completions", orjson.dumps(body)
        return f"{self.base_url}/completions", orjson.dumps({**common, "prompt": prompt, "stop": list(STOP)})

    def _parse(self, body: bytes) -> tuple[str, int | None, str | None]:
        """(text, completion tokens, finish reason) of a 200's body; _Malformed when it is not one."""
        try:
            data = orjson.loads(body)
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.config.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Malformed(f"not an OpenAI {self.config.api} response: {body[:200]!r}") from exc
        if text is None and self.config.api == "chat":
            text = ""  # a chat message without content is an empty answer, not a broken response
        if not isinstance(text, str):
            raise _Malformed(f"the answer text is a {type(text).__name__}, not a string: {body[:200]!r}")
        usage = data.get("usage") if isinstance(data, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        return (
            text,
            tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None,
            finish if isinstance(finish, str) else None,
        )

    async def _attempt(self, url: str, payload: bytes) -> tuple[str, int | None, str | None, float]:
        start = time.perf_counter()
        try:
            async with self.session.post(url, data=payload) as response:
                try:
                    body = await response.read()
                except aiohttp.ClientPayloadError as exc:
                    if response.status == 200 and _is_decoding_error(exc):
                        raise _Malformed(f"the body does not decode ({exc})") from exc
                    raise
                status, headers = response.status, response.headers
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        if status in TRANSIENT_STATUS:
            raise _Transient(_describe(status, url, body), _retry_after(headers))
        if status != 200:
            raise QuestionFailed(_describe(status, url, body), 0, kind="http")
        text, tokens, finish = self._parse(body)
        return text, tokens, finish, time.perf_counter() - start

    async def complete(self, prompt: str) -> Completion:
        if self.model is None:
            raise RuntimeError("Cannot send a request before resolve_model() has chosen the model.")
        url, payload = self._body(prompt)
        retry = self.config.retry
        retries = malformed = 0
        first_failed = False
        attempt = 0
        while True:
            try:
                text, tokens, finish, latency_s = await self._attempt(url, payload)
            except _Transient as exc:
                first_failed = first_failed or attempt == 0
                if retries >= retry.max_retries:
                    raise QuestionFailed(
                        f"{exc} (gave up after {retries} retries)",
                        retries,
                        first_attempt_failed=first_failed,
                        invalid_responses=malformed,
                    ) from exc
                self.retries += 1
                await asyncio.sleep(retry.delay(retries, exc.retry_after))
                retries += 1
            except _Malformed as exc:
                malformed += 1
                if malformed > 1:
                    raise QuestionFailed(
                        f"Malformed response from {url} twice: {exc}",
                        retries,
                        kind="invalid_response",
                        first_attempt_failed=first_failed,
                        invalid_responses=malformed,
                    ) from exc
                self.retries += 1
                retries += 1
            except QuestionFailed as exc:
                exc.retries, exc.first_attempt_failed, exc.invalid_responses = retries, first_failed, malformed
                raise
            else:
                return Completion(
                    text=text,
                    completion_tokens=tokens,
                    finish_reason=finish,
                    latency_s=latency_s,
                    retries=retries,
                    first_attempt_failed=first_failed,
                    invalid_responses=malformed,
                )
            attempt += 1
