"""Bound the memory request bodies take: each body (413 beyond `max_bytes`, by Content-Length up
front or while reading) and all bodies held at once (503 with Retry-After beyond `max_in_flight`).

The body is read here (the router needs all of it anyway) and replayed to the app, so a body that
turns out too large is refused before the app has seen any of it. Its bytes count against the
shared budget from their arrival until the request is answered, since the parsed request lives
that long; a Content-Length body reserves its whole length before a byte is read.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ....common.openai_errors import error_body
from .respond import send_json

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        max_in_flight: int,
        on_reject: Callable[[Scope, int], None] | None = None,
    ) -> None:
        """`on_reject(scope, status)`: told of each request this middleware answers itself."""
        self.app = app
        self.on_reject = on_reject
        self.max_bytes = max_bytes
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # bytes of the bodies held now (one event loop: no lock needed)
        self._too_large = error_body(
            413,
            f"The request body is larger than the router's limit of {max_bytes} bytes. "
            "Send a smaller request, or raise --max-body-bytes.",
            code="request_too_large",
        )
        self._too_many = error_body(
            503,
            f"The router holds its limit of {max_in_flight} bytes of request bodies at once. Retry shortly, "
            "or raise --max-body-bytes-in-flight.",
            code="overloaded",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared > self.max_bytes:
            self._rejected(scope, 413)
            await send_json(send, 413, self._too_large, (b"connection", b"close"))
            return
        held = 0  # this request's share of in_flight
        try:
            if declared > 0:
                if not self._reserve(declared):
                    await self._busy(scope, send)
                    return
                held = declared
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left while sending
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    self._rejected(scope, 413)
                    await send_json(send, 413, self._too_large, (b"connection", b"close"))
                    return
                if size > held:  # chunked, or more than declared: reserve as the bytes come
                    if not self._reserve(size - held):
                        await self._busy(scope, send)
                        return
                    held = size
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.in_flight -= held

    def _reserve(self, size: int) -> bool:
        if self.in_flight + size > self.max_in_flight:
            return False
        self.in_flight += size
        return True

    def _rejected(self, scope: Scope, status: int) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, status)

    async def _busy(self, scope: Scope, send: Send) -> None:
        self._rejected(scope, 503)
        await send_json(send, 503, self._too_many, (b"retry-after", b"1"), (b"connection", b"close"))


def _content_length(scope: Scope) -> int:
    """The declared body length; -1 when there is none (chunked) or it is not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1
