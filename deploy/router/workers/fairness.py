"""Who a request belongs to, and what each client holds of the decodes' capacity: the input of the
capacity gate's fair share (capacity.py).

A client is its API key when the router has client keys (`--api-key`; the admin key counts as one
more client), else the address it connects from. Keys are kept as a short hash: the ledger never
holds a secret. Behind a proxy that hides client addresses and without keys every request looks
like one client, and the fair share never binds.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar

from starlette.types import Scope

__all__ = ["ClientLedger", "client_identity", "client_var"]

# The client of the request being served (set by the app for each inference request).
client_var: ContextVar[str] = ContextVar("sglang_pd_client", default="")


def client_identity(scope: Scope, keyed: bool) -> str:
    """`key:<hash>` of the request's bearer token when the router has keys, else `addr:<host>`."""
    if keyed:
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = value.partition(b" ")[2].strip()
                return "key:" + hashlib.blake2b(token, digest_size=8).hexdigest()
        return "key:"
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:"


class ClientLedger:
    """Requests (slots) and decode tokens each client holds reserved, while it holds any."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}

    def add(self, client: str, slots: int, tokens: int) -> None:
        held = self._held.setdefault(client, [0, 0])
        held[0] += slots
        held[1] += tokens

    def sub(self, client: str, slots: int, tokens: int) -> None:
        held = self._held.get(client)
        if held is None:
            return
        held[0] -= slots
        held[1] -= tokens
        if held[0] <= 0:
            del self._held[client]

    def held(self, client: str) -> tuple[int, int]:
        slots, tokens = self._held.get(client, (0, 0))
        return slots, tokens

    def clients(self) -> set[str]:
        return set(self._held)
