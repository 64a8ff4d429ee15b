"""The reference engine's exceptions.

    RefEngineError      base of every error the reference engine raises on purpose
    ├── RequestFailed   a request cannot be served; `status` is the HTTP status to answer with
    ├── ClaimRejected   the prefill refused or failed a decode's claim of a room; carries a status
    └── PoolExhausted   no free KV pages are left for a request

The HTTP layer answers RequestFailed with sglang's error body for the route (`server.sglang_error`).
"""

from __future__ import annotations

__all__ = ["ClaimRejected", "PoolExhausted", "RefEngineError", "RequestFailed"]


class RefEngineError(Exception):
    """Base of every error the reference engine raises on purpose."""


class RequestFailed(RefEngineError):
    """A request cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class ClaimRejected(RefEngineError):
    """The prefill side refused or failed the handshake for a room; carries an HTTP status."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class PoolExhausted(RefEngineError, RuntimeError):
    """No free pages are left for a request."""
