"""The router's exceptions.

    RouterError
    ├── NoHealthyWorker         no prefill or decode worker can take a request now
    ├── WorkerRegistrationError a worker URL or role given to /workers or the CLI is invalid
    └── UpstreamError           a worker leg failed (carries the worker)
        ├── UpstreamUnreachable connecting or sending to the worker failed
        ├── UpstreamTimeout     the worker did not answer within the timeout
        └── UpstreamStatusError the worker answered with a 5xx status

`map_client_exceptions()` turns the HTTP client's transport errors (aiohttp) into the most specific
UpstreamError, chained with `from exc`; anything else is re-raised unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from .workers import Worker

__all__ = [
    "NoHealthyWorker",
    "RouterError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "WorkerRegistrationError",
    "map_client_exceptions",
]


class RouterError(Exception):
    """Base class of every error the router raises on purpose."""


class NoHealthyWorker(RouterError):
    """No worker of the needed role is healthy with its circuit breaker closed."""

    def __init__(self, role: str) -> None:
        super().__init__(
            f"No healthy {role} worker is available; check `GET /workers` and the workers' /health, "
            f"or register one with `POST /workers`."
        )
        self.role = role


class WorkerRegistrationError(RouterError):
    """A worker given to /workers, the CLI or discovery is invalid."""


class UpstreamError(RouterError):
    """A request to a worker failed."""

    def __init__(self, message: str, worker: Worker) -> None:
        super().__init__(message)
        self.worker = worker


class UpstreamUnreachable(UpstreamError):
    """Connecting or sending to the worker failed, or it closed the connection."""


class UpstreamTimeout(UpstreamError):
    """The worker did not answer within the configured timeout."""


class UpstreamStatusError(UpstreamError):
    """The worker answered with a 5xx status."""

    def __init__(self, message: str, worker: Worker, status: int, body: bytes) -> None:
        super().__init__(message, worker)
        self.status = status
        self.body = body


# Most specific first: aiohttp's ServerTimeoutError and ConnectionTimeoutError are both
# ClientErrors and TimeoutErrors; a `total` timeout is a bare TimeoutError.
_CLIENT_MAP: tuple[tuple[type[BaseException], type[UpstreamError]], ...] = (
    (TimeoutError, UpstreamTimeout),
    (aiohttp.ClientError, UpstreamUnreachable),
)


@contextmanager
def map_client_exceptions(worker: Worker, what: str) -> Iterator[None]:
    """Translate transport errors raised inside the block into UpstreamError subclasses."""
    try:
        yield
    except (TimeoutError, aiohttp.ClientError) as exc:
        for source, target in _CLIENT_MAP:
            if isinstance(exc, source):
                detail = str(exc) or type(exc).__name__
                raise target(f"{what} to {worker.role} worker {worker.url} failed: {detail}", worker) from exc
        raise
