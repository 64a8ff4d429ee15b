"""Limits on a request's head (request line and headers), enforced while it is being parsed.

An ASGI middleware sees a request only once its whole head has been parsed and held in memory,
so a 96 MB header would already be in the router's memory (and any auth check too late). These
limits live in the HTTP protocol that uvicorn runs per connection instead: a subclass of uvicorn's
httptools protocol counts the head's bytes as they arrive, before the parser buffers them, and
answers 414 (request line too long) or 431 (headers too large or too many) with the OpenAI error
body, then closes the connection. Nothing reaches the app, so the limits apply before auth and
before the body is read. nginx's defaults are of the same order (`large_client_header_buffers
4 8k`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..openai_errors import error_body
from .log import logger

__all__ = ["DEFAULT_HEAD_LIMITS", "HeadLimitedProtocol", "HeadLimits"]

_LINGER_S = 0.5
_REASONS = {414: b"URI Too Long", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadLimits:
    """Bytes of the request line, bytes of the whole head, and the number of header fields."""

    max_request_line_bytes: int = 8 * 1024
    max_head_bytes: int = 64 * 1024
    max_header_count: int = 100


DEFAULT_HEAD_LIMITS = HeadLimits()


class _HeadTooLarge(Exception):
    """Raised inside a parser callback to stop parsing; the protocol answers `status`."""


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` on every request head of the connection."""

    limits: HeadLimits = DEFAULT_HEAD_LIMITS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._head_done = False
        self._refusal: tuple[int, str] | None = None
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: the connection is closing, ignore what is still arriving
        if not self._head_done:
            # Count only up to the end of the head: the body may follow in the same chunk.
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(
                    431,
                    f"The request's headers are larger than the router's limit of {self.limits.max_head_bytes} bytes.",
                )
                self._send_refusal()
                return
        super().data_received(data)

    # Parser callbacks: raising stops the parser; uvicorn then calls send_400_response.
    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            self._refuse(
                414,
                f"The request's URL is longer than the router's limit of {self.limits.max_request_line_bytes} bytes.",
            )
            raise _HeadTooLarge()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if len(self.headers) > self.limits.max_header_count:
            self._refuse(
                431, f"The request has more than the router's limit of {self.limits.max_header_count} header fields."
            )
            raise _HeadTooLarge()

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_done = False
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._send_refusal()

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        logger.warning("request head refused", extra={"status": status, "client": self.client, "reason": message})

    def _send_refusal(self) -> None:
        assert self._refusal is not None
        status, message = self._refusal
        body = error_body(status, message + " Send a smaller request.", code="request_head_too_large")
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        if self.transport.is_closing():
            return
        self.transport.write(head + body)
        # Stop reading and close a moment later: closing at once, with the rest of the head
        # unread, makes the kernel reset the connection before the client has read the answer.
        self.transport.pause_reading()
        self.loop.call_later(_LINGER_S, self.transport.close)
