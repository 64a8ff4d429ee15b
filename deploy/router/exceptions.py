"""The router's exceptions.

    RouterError
    ├── ClientGone              the client disconnected before its answer was ready
    ├── ControlLost             a process group's control process is gone (also a ConnectionError)
    ├── NoHealthyWorker         no prefill or decode worker can take a request now
    ├── WorkerAtCapacity        every healthy worker of a role has all the requests it may take
    ├── WorkerRegistrationError a worker URL or role given to /workers or the CLI is invalid
    └── UpstreamError           a worker leg failed (carries the worker)
        ├── UpstreamUnreachable connecting or sending to the worker failed
        ├── UpstreamTimeout     the worker did not answer within the timeout
        ├── UpstreamStatusError the worker answered with a 5xx status
        └── UpstreamBusy        the worker answered that it is full (429, or sglang's 503 queue full)

Transports (`transport.py`) raise the most specific UpstreamError, chained with `from exc` to the
HTTP client's own error. Errors answered to the client as they are (bad input, 503, 504) are
`openai_errors.ApiError`, which carries the OpenAI error fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .workers.registry import Worker

__all__ = [
    "ClientGone",
    "ControlLost",
    "NoHealthyWorker",
    "RouterError",
    "UpstreamBusy",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "WorkerAtCapacity",
    "WorkerRegistrationError",
]


class RouterError(Exception):
    """Base class of every error the router raises on purpose."""


class ClientGone(RouterError):
    """The client disconnected before its answer was ready."""


class ControlLost(RouterError, ConnectionError):
    """The control process is gone: admin changes cannot be made through this process now."""


class NoHealthyWorker(RouterError):
    """No worker of the needed role is healthy with its circuit breaker closed."""

    def __init__(self, role: str) -> None:
        super().__init__(
            f"No healthy {role} worker is available; check `GET /workers` and the workers' /health, "
            f"or register one with `POST /workers`."
        )
        self.role = role


class WorkerAtCapacity(RouterError):
    """Every healthy worker of a role has as many requests as it may take (`capacity.py`)."""

    def __init__(self, role: str) -> None:
        super().__init__(f"Every healthy {role} worker is at its capacity.")
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


class UpstreamBusy(UpstreamError):
    """The worker answered that it is full: a 429, or sglang's 503 for a full queue. Not a failure
    of the worker: nothing counts against its breaker, and the client is asked to retry later."""

    def __init__(self, message: str, worker: Worker, status: int, retry_after: str) -> None:
        super().__init__(message, worker)
        self.status = status
        self.retry_after = retry_after
