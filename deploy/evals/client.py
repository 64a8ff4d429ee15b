"""An async client for one OpenAI-compatible endpoint: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Transient failures (connection errors, timeouts, 408/429/5xx) are retried with exponential backoff
and counted; anything else fails the question at once. Neither is ever dropped silently.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from .errors import EndpointUnreachable
from .prompt import STOP

__all__ = [
    "DEFAULT_RETRY",
    "Api",
    "ClientConfig",
    "Completion",
    "EndpointClient",
    "RequestFailed",
    "RetryPolicy",
]

Api = Literal["completions", "chat"]

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


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    completion_tokens: int | None
    finish_reason: str | None
    latency_s: float
    retries: int


class RequestFailed(Exception):
    """One question's request failed for good (after `retries` retries)."""

    def __init__(self, message: str, retries: int) -> None:
        super().__init__(message)
        self.retries = retries


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def _model_ids(response: httpx.Response) -> list[str]:
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EndpointUnreachable(
            f"{response.request.url} did not answer an OpenAI model list ({response.text[:200]!r}); "
            "check --base-url (it should end in /v1)."
        ) from exc


def _describe(response: httpx.Response) -> str:
    body = response.text.strip().replace("\n", " ")
    return f"HTTP {response.status_code} from {response.request.url}: {body[:300]}"


class EndpointClient:
    """Use as `async with EndpointClient(config) as client:`; `resolve_model()` first, then `complete()`."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self.model: str | None = config.model
        # Every retry of a question's request, including those of requests cancelled mid-way.
        self.retries = 0
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=config.parallel, max_keepalive_connections=config.parallel),
        )

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

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
                response = await self._http.get(url)
            except httpx.TransportError as exc:
                problem, cause = f"Cannot reach {url} ({type(exc).__name__}: {exc}). {hint}", exc
            else:
                if response.status_code in (401, 403):
                    raise EndpointUnreachable(f"{_describe(response)}. Pass the key with --api-key or OPENAI_API_KEY.")
                if response.status_code in TRANSIENT_STATUS:
                    problem, retry_after = f"{_describe(response)}. {hint}", _retry_after(response)
                elif response.status_code != 200:
                    raise EndpointUnreachable(f"{_describe(response)}. {hint}.")
                else:
                    models = _model_ids(response)
                    if models:
                        self.model = self.model or models[0]
                        return self.model
                    problem = f"{url} lists no model yet (a router with no healthy worker?): {response.text[:200]!r}"
            remaining = deadline - time.monotonic()
            if attempt >= retry.max_retries and remaining <= 0:
                if self.model is not None and cause is None and retry_after is None:
                    return self.model  # a server that lists no model but was named one: let the requests tell
                raise EndpointUnreachable(f"{problem}; --wait-ready SECONDS waits longer.") from cause
            delay = retry.delay(attempt, retry_after)
            await asyncio.sleep(min(delay, 5.0, remaining) if remaining > 0 else delay)
            attempt += 1

    def _body(self, prompt: str) -> tuple[str, dict[str, Any]]:
        common: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        if self.config.api == "chat":
            return "/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
        return "/completions", {**common, "prompt": prompt, "stop": list(STOP)}

    def _parse(self, response: httpx.Response, latency_s: float, retries: int) -> Completion:
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.config.api == "chat" else choice["text"]
            usage = data.get("usage") or {}
            tokens = usage.get("completion_tokens")
            return Completion(
                text=text or "",
                completion_tokens=int(tokens) if tokens is not None else None,
                finish_reason=choice.get("finish_reason"),
                latency_s=latency_s,
                retries=retries,
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise RequestFailed(
                f"Not an OpenAI {self.config.api} response from {response.request.url}: {response.text[:200]!r}",
                retries,
            ) from exc

    async def _attempt(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        try:
            response = await self._http.post(self.base_url + path, json=body)
        except httpx.TransportError as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        if response.status_code in TRANSIENT_STATUS:
            raise _Transient(_describe(response), _retry_after(response))
        return response, time.perf_counter() - start

    async def complete(self, prompt: str) -> Completion:
        if self.model is None:
            raise RuntimeError("Cannot send a request before resolve_model() has chosen the model.")
        path, body = self._body(prompt)
        retry = self.config.retry
        for attempt in range(retry.max_retries + 1):
            try:
                response, latency_s = await self._attempt(path, body)
            except _Transient as exc:
                if attempt == retry.max_retries:
                    raise RequestFailed(f"{exc} (gave up after {attempt} retries)", attempt) from exc
                self.retries += 1
                await asyncio.sleep(retry.delay(attempt, exc.retry_after))
                continue
            if response.status_code != 200:
                raise RequestFailed(_describe(response), attempt)
            return self._parse(response, latency_s, attempt)
        raise AssertionError("unreachable")
