"""A request's two ids (docs/pd-protocol.md, "Request ids").

The router's own id names the request to the engines (`rid`, and `/abort_request` when it is
given up): random and new for every request, so no client can name, and so abort, another's
engine work. The client's `X-Request-ID` is only logged (`client_request_id`) and echoed back:
two clients may send the same one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from starlette.types import Scope

__all__ = ["RequestIds", "request_ids"]

# A client's X-Request-ID worth logging and echoing; anything else is dropped.
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")

_ID_BYTES = 16
# Ids drawn from one os.urandom call: one getrandom() system call per this many requests, not one
# each (1 % of the router's CPU in a native py-spy profile of benchmarks/bench_router.py).
_IDS_PER_DRAW = 256


class _RandomIds:
    """128-bit ids from the operating system's CSPRNG, read in batches. A forked child forgets the
    batch, so that no two processes hand out the same ids."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._at = b"", 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(_ID_BYTES * _IDS_PER_DRAW), 0
        self._at = at + _ID_BYTES
        return self._pool[at : at + _ID_BYTES].hex()


_random_ids = _RandomIds()


@dataclass(frozen=True, slots=True)
class RequestIds:
    """`router`: the id the engines and the router's logs know the request by (`request_id`);
    `client`: the client's X-Request-ID, "" when it sent none or an invalid one."""

    router: str
    client: str = ""

    @property
    def headers(self) -> dict[str, str]:
        """The answer's id headers: `x-request-id` echoes the client's (else the router's id)."""
        return {"x-request-id": self.client or self.router, "x-router-request-id": self.router}


def request_ids(scope: Scope) -> RequestIds:
    """A new router id (128 random bits, hex) and the client's X-Request-ID when it is a sane token."""
    router = _random_ids.next()
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            return RequestIds(router, given if _CLIENT_ID.match(given) else "")
    return RequestIds(router)
