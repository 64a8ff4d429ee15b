"""Bearer-token checks: client API keys for the OpenAI endpoints, a separate admin key for /workers and /admin/.

/workers and /admin/ need the admin key whenever any key is configured; with no key at all (a dev
setup) only their GET is open. The admin key is also accepted on the inference routes, and such a
request may set engine-internal fields (`router/api/fields.py`) and pin itself to a revision with
the x-sglpd-revision header (`workers/rollout.py`); the header without the admin key is a 403."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from ....common.openai_errors import error_body
from ....spec.revision import revision_problem
from .respond import send_json

__all__ = ["ADMIN_SCOPE_KEY", "PIN_SCOPE_KEY", "AuthMiddleware"]

# Set in the ASGI scope of an inference request: whether it carries the admin key.
ADMIN_SCOPE_KEY = "sglang_pd.admin"
# Set in the ASGI scope of an admin request pinned to a revision: the revision (x-sglpd-revision).
PIN_SCOPE_KEY = "sglang_pd.pinned_revision"
_PIN_HEADER = b"x-sglpd-revision"
_PIN_NEEDS_ADMIN = (
    "The x-sglpd-revision header pins a request to one revision and is honoured only with the admin key "
    "('Authorization: Bearer <admin key>', the router's --admin-key): client requests go to the approved revision. "
    "Remove the header, or send the admin key."
)

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
        self._pin_needs_admin = error_body(403, _PIN_NEEDS_ADMIN, code="pin_needs_admin_key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if path == "/workers" or path.startswith(("/workers/", "/admin/")):
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
            token, pin = _token_and_pin(scope)
            # The admin key also serves the inference routes, where it lets engine-internal
            # fields through (router/api/fields.py) and pins a request to a revision.
            admin = bool(self.admin_key) and _matches(token, (self.admin_key,))
            if self.api_keys and not admin and not _matches(token, self.api_keys):
                await self._deny(scope, send, 401, self._bad_key)
                return
            scope[ADMIN_SCOPE_KEY] = admin
            if pin is not None:
                if not admin:
                    await self._deny(scope, send, 403, self._pin_needs_admin)
                    return
                revision = pin.decode("latin-1").strip()
                if (problem := revision_problem(revision)) is not None:
                    await self._deny(
                        scope, send, 400, error_body(400, f"x-sglpd-revision: {problem}", code="invalid_value")
                    )
                    return
                scope[PIN_SCOPE_KEY] = revision
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


def _token_and_pin(scope: Scope) -> tuple[bytes, bytes | None]:
    """The bearer token and the x-sglpd-revision header (None: absent), in one pass over the headers."""
    token, pin, seen = b"", None, False
    for name, value in scope["headers"]:
        if name == b"authorization" and not seen:
            scheme, _, given = value.partition(b" ")
            token, seen = (given.strip() if scheme.lower() == b"bearer" else b""), True
        elif name == _PIN_HEADER:
            pin = value
    return token, pin


def _matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key so the time taken does not say which key was close.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok and bool(token)
