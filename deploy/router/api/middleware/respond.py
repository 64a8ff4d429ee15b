"""The middlewares' early answer: a complete JSON response sent straight to ASGI, before the app
has seen the request (precomputed bodies, so a rejection costs no serialisation)."""

from __future__ import annotations

from starlette.types import Send

__all__ = ["send_json"]


async def send_json(send: Send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    """Send `body` (JSON) with `status` and any extra headers, as the whole response."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
