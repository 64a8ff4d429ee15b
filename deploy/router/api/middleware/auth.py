"""Bearer-token checks: client API keys for the OpenAI endpoints, a separate admin key for /workers.

/workers needs the admin key whenever any key is configured; with no key at all (a dev setup)
only its GET is open. The admin key is also accepted on the inference routes, and such a request
may set engine-internal fields (`router/api/fields.py`)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from ....common.openai_errors import error_body
from .respond import send_json

__all__ = ["ADMIN_SCOPE_KEY", "AuthMiddleware"]

# Set in the ASGI scope of an inference request: whether it carries the admin key.
ADMIN_SCOPE_KEY = "sglang_pd.admin"

_OPEN_PATHS = frozenset({"/health", "/readiness", "/metrics", "/openapi.json"})
_BAD_KEY = (
    "Invalid or missing API key. Send 'Authorization: Bearer <key>' with a key configured on the router (--api-key)."
)
_BAD_ADMIN_KEY = "Invalid or missing admin key. Send 'Authorization: Bearer <admin key>' (--admin-key)."
_NO_ADMIN = (
    "The /workers admin API is disabled because no admin key is configured. "
    "Start the router with --admin-key to enable it."
)


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: tuple[str, ...],
        admin_key: str,
        on_reject: Callable[[Scope, int], None] | None = None,
    ) -> None:
        """`on_reject(scope, status)`: told of each request this middleware answers itself."""
        self.app = app
        self.on_reject = on_reject
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.admin_key = admin_key.encode()
        self._bad_key = error_body(401, _BAD_KEY, code="invalid_api_key")
        self._bad_admin = error_body(401, _BAD_ADMIN_KEY, code="invalid_api_key")
        self._no_admin = error_body(403, _NO_ADMIN, code="admin_disabled")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if path == "/workers" or path.startswith("/workers/"):
            if self.admin_key:
                if not _matches(_bearer(scope), (self.admin_key,)):
                    await self._deny(scope, send, 401, self._bad_admin)
                    return
            elif self.api_keys or scope["method"] not in ("GET", "HEAD"):
                # With client keys configured the router is not open, so neither is its worker
                # list (internal addresses); with no key at all it is a dev setup and GET is fine.
                await self._deny(scope, send, 403, self._no_admin)
                return
        else:
            token = _bearer(scope)
            # The admin key also serves the inference routes, where it lets engine-internal
            # fields through (router/api/fields.py).
            admin = bool(self.admin_key) and _matches(token, (self.admin_key,))
            if self.api_keys and not admin and not _matches(token, self.api_keys):
                await self._deny(scope, send, 401, self._bad_key)
                return
            scope[ADMIN_SCOPE_KEY] = admin
        await self.app(scope, receive, send)

    async def _deny(self, scope: Scope, send: Send, status: int, body: bytes) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, status)
        await send_json(send, status, body, (b"www-authenticate", b"Bearer"))


def _bearer(scope: Scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key so the time taken does not say which key was close.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok and bool(token)
