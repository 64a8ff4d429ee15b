"""The one interface the router has to its workers: `WorkerClient`.

`post` (a whole answer), `open_stream` (an answer whose body is relayed chunk by chunk), `abort`
(`/abort_request`, best effort) and `get` (health and info probes; a generation probe has a
timeout of its own, `health.py` says why). The base class holds what every transport must do
alike: headers (the worker API key, the request id), timeouts, and the mapping of answers to
errors (5xx, or a stream whose first event is an error, is an `UpstreamStatusError`; a 429, and
sglang's 503 for a full queue, also as a stream's first event, is an `UpstreamBusy`; other 4xx
are the engine's verdict and go back to the client). A transport implements one primitive, `_send`,
and raises the `UpstreamError` subclasses from `exceptions`.

`HttpWorkerClient` is the real transport, on the router's own small HTTP/1.1 client (`http1`, which
says why). Tests plug in an in-process transport behind the same class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

import orjson

from ...common.contract import unsendable_key
from ..exceptions import UpstreamBusy, UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamUnreachable
from ..log import logger
from ..tracing import leg_headers
from ..workers.registry import Worker
from .http1 import Answer, Http1Client

__all__ = ["Body", "HttpWorkerClient", "Reply", "Timeouts", "WorkerClient"]

Purpose = Literal["unary", "stream", "abort", "health", "health_generate"]

# What sglang says when it refuses a request for load, with status 503 (`Scheduler`:
# `_abort_on_queued_limit`, and the SGLANG_REQ_WAITING_TIMEOUT abort): the engine works, it is full.
BUSY_MESSAGES = (
    b"The request queue is full.",
    b"The request is aborted by a higher priority request.",
    b"Request waiting timeout reached.",
)
# A busy engine sends no Retry-After; its queue moves within about a second.
BUSY_RETRY_AFTER = "1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Seconds. `request` bounds a whole unary answer; `stream_idle` each read of a stream (its
    first chunk included: the first byte's overall deadline is the proxy's); `abort` and `health`
    bound those short calls; `health_generate` a generation probe (sglang's `/health`)."""

    connect: float = 3.0
    request: float = 600.0
    stream_idle: float = 120.0
    abort: float = 2.0
    health: float = 2.0
    health_generate: float = 25.0


class Body(Protocol):
    """A response body being received."""

    async def read(self) -> bytes:
        """The rest of the body."""
        ...

    async def next_chunk(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end."""
        ...

    def release(self) -> None:
        """The body was read to its end: the connection may be reused."""
        ...

    def close(self) -> None:
        """Give up on the body: the worker sees the connection close."""
        ...


@dataclass(slots=True)
class Reply:
    """A worker's answer: its whole body, or (`stream` set) the first chunk and the open rest."""

    status: int
    content_type: str
    body: bytes = b""
    stream: Body | None = None


class WorkerClient(ABC):
    """Requests to workers, with the router's headers, timeouts and error mapping."""

    def __init__(self, *, timeouts: Timeouts = Timeouts(), api_key: str = "") -> None:
        self.timeouts = timeouts
        self.headers = {"content-type": "application/json"}
        if api_key:
            if unsendable_key(api_key):
                raise ValueError(
                    "The worker API key has spaces or control characters (a trailing newline from a file?), "
                    "which no HTTP header can carry; strip them from the key."
                )
            self.headers["authorization"] = f"Bearer {api_key}"

    @abstractmethod
    async def _send(
        self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str], purpose: Purpose
    ) -> tuple[int, str, Body]:
        """Send one request; return (status, content type, body) once the headers arrived.
        Raises UpstreamUnreachable or UpstreamTimeout."""

    async def aclose(self) -> None:  # noqa: B027 (a transport without connections has nothing to close)
        """Release connections; the client may be used again afterwards."""

    async def post(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """POST and read the whole answer. A 5xx raises UpstreamStatusError (UpstreamBusy for a 429
        or sglang's 503 for a full queue)."""
        headers = {**self.headers, "x-request-id": rid}
        if (traced := leg_headers.get()) is not None:  # the leg's span context (tracing.py)
            headers.update(traced)
        status, content_type, stream = await self._send(worker, "POST", path, body, headers, "unary")
        content = await _read_all(stream)
        if status >= 500 or status == 429:
            raise _status_error(worker, path, status, content)
        return Reply(status, content_type, content)

    async def open_stream(self, worker: Worker, path: str, body: bytes, rid: str) -> Reply:
        """POST and wait for the first chunk of the body; the caller owns `Reply.stream` then.
        A 4xx comes back whole (a 429 raises UpstreamBusy, as a busy 503 or first event does); a 5xx,
        or a first event that is an error, raises
        UpstreamStatusError (nothing reached the client, so the request can still be retried)."""
        headers = {**self.headers, "x-request-id": rid}
        if (traced := leg_headers.get()) is not None:
            headers.update(traced)
        status, content_type, stream = await self._send(worker, "POST", path, body, headers, "stream")
        if status >= 400:
            content = await _read_all(stream)
            if status >= 500 or status == 429:
                raise _status_error(worker, path, status, content)
            return Reply(status, content_type, content)
        try:
            first = await stream.next_chunk()
        except BaseException:
            stream.close()
            raise
        if _busy_event(first):
            # sglang answers a full queue with 200, then says so in the first event.
            stream.close()
            raise UpstreamBusy(
                f"{worker.role} worker {worker.url} is full: {first[:300]!r}", worker, 503, BUSY_RETRY_AFTER
            )
        if first[:24].replace(b" ", b"").startswith(b'data:{"error"'):
            # sglang reports a failed KV transfer as the stream's first event.
            stream.close()
            raise UpstreamStatusError(
                f"{worker.role} worker {worker.url} answered the stream with an error: {first[:300]!r}",
                worker,
                502,
                first,
            )
        return Reply(status, content_type, first, stream)

    async def abort(self, worker: Worker, rid: str) -> None:
        """Ask a worker to drop request `rid`; a failure is logged, not raised (best effort)."""
        try:
            _, _, stream = await self._send(
                worker, "POST", "/abort_request", orjson.dumps({"rid": rid}), self.headers, "abort"
            )
            await _read_all(stream)
        except UpstreamError as exc:
            logger.info("abort_request failed", extra={"worker": worker.url, "rid": rid, "error": str(exc)})

    async def get(self, worker: Worker, path: str, purpose: Purpose = "health") -> tuple[int, bytes]:
        """GET a probe or info path: (status, body). Raises UpstreamError when unreachable."""
        status, body, _ = await self.probe(worker, path, purpose)
        return status, body

    async def probe(self, worker: Worker, path: str, purpose: Purpose = "health") -> tuple[int, bytes, str]:
        """`get`, plus the answer's `x-sglpd-refused` ("" when absent): which connection cap of the
        worker's HTTP server refused the connection (common/http_limits.py), not its application."""
        status, _, stream = await self._send(worker, "GET", path, b"", self.headers, purpose)
        refused = getattr(stream, "refused", "")  # a transport without the header has none
        return status, await _read_all(stream), refused if isinstance(refused, str) else ""


async def _read_all(stream: Body) -> bytes:
    try:
        content = await stream.read()
    except BaseException:
        stream.close()
        raise
    stream.release()
    return content


def _busy_event(first: bytes) -> bool:
    """Whether a stream's first event is sglang's refusal for load: an error event with code 503 on
    its OpenAI routes, an output whose finish reason is an abort with status_code 503 on /generate."""
    head = first[:2000]
    if not any(m in head for m in BUSY_MESSAGES):
        return False
    compact = head.replace(b" ", b"")
    return b'"code":503' in compact or b'"status_code":503' in compact


def _status_error(worker: Worker, path: str, status: int, content: bytes) -> UpstreamError:
    if status == 429 or (status == 503 and any(m in content[:2000] for m in BUSY_MESSAGES)):
        return UpstreamBusy(
            f"POST {path} to {worker.role} worker {worker.url} answered {status}, it is full: {content[:200]!r}",
            worker,
            status,
            BUSY_RETRY_AFTER,
        )
    return UpstreamStatusError(
        f"POST {path} to {worker.role} worker {worker.url} answered {status}: {content[:200]!r}",
        worker,
        status,
        content,
    )


# -- HTTP/1.1 -----------------------------------------------------------------------------------


class _Http1Body:
    """A worker's answer body read through `http1`, its errors mapped to UpstreamError."""

    __slots__ = ("_answer", "_worker")

    def __init__(self, answer: Answer, worker: Worker) -> None:
        self._answer = answer
        self._worker = worker

    async def read(self) -> bytes:
        try:
            return await self._answer.read()
        except (OSError, TimeoutError) as exc:
            raise _upstream_error(exc, self._worker, "reading the answer") from exc

    async def next_chunk(self) -> bytes:
        try:
            return await self._answer.next_chunk()
        except (OSError, TimeoutError) as exc:
            raise _upstream_error(exc, self._worker, "streaming the answer") from exc

    @property
    def refused(self) -> str:
        return self._answer.refused

    def release(self) -> None:
        self._answer.release()

    def close(self) -> None:
        self._answer.close()


def _upstream_error(exc: BaseException, worker: Worker, what: str) -> UpstreamError:
    kind = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamUnreachable
    detail = str(exc) or type(exc).__name__
    return kind(f"{what} to {worker.role} worker {worker.url} failed: {detail}", worker)


class HttpWorkerClient(WorkerClient):
    """Workers over HTTP/1.1 (`http1`): keep-alive pools per worker, no connection limit
    (admission control bounds them)."""

    def __init__(self, *, timeouts: Timeouts = Timeouts(), api_key: str = "", keepalive_s: float = 4.0) -> None:
        super().__init__(timeouts=timeouts, api_key=api_key)
        t = timeouts
        # (connect, whole answer, each read) in seconds, per purpose.
        self._limits: dict[Purpose, tuple[float, float | None, float | None]] = {
            "unary": (t.connect, t.request, None),
            "stream": (t.connect, None, t.stream_idle),
            "abort": (min(t.connect, t.abort), t.abort, None),
            "health": (min(t.connect, t.health), t.health, None),
            "health_generate": (min(t.connect, t.health), t.health_generate, None),
        }
        self._http = Http1Client(keepalive_s=keepalive_s)

    async def _send(
        self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str], purpose: Purpose
    ) -> tuple[int, str, Body]:
        connect_s, total_s, idle_s = self._limits[purpose]
        try:
            answer = await self._http.request(
                worker.url, method, path, body, headers, connect_s=connect_s, total_s=total_s, idle_s=idle_s
            )
        except (OSError, TimeoutError) as exc:
            raise _upstream_error(exc, worker, f"{method} {path}") from exc
        default_type = "text/event-stream" if purpose == "stream" else "application/json"
        return answer.status, answer.content_type or default_type, _Http1Body(answer, worker)

    async def aclose(self) -> None:
        self._http.close()
