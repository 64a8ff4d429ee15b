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
    router = os.urandom(16).hex()
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            return RequestIds(router, given if _CLIENT_ID.match(given) else "")
    return RequestIds(router)
